"""Closable resources: one place for the context-manager and finaliser
behaviour that every handle, mapping and socket of ump shares."""

from __future__ import annotations

__all__ = ["Resource"]


class Resource:
    """Something with a ``close()`` that may run more than once: ``with``
    closes it on exit, and collection closes it if the owner did not."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may be gone
            pass
