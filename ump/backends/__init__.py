"""The backends ump can enable, and how ``backend="auto"`` picks one.

Each backend is a small description: which kind of memory its arenas hold,
where their chunks come from, and what the machine must offer. The arena,
the registry and the framework hooks are the same for all of them.
"""

from __future__ import annotations

from .._errors import BackendUnavailableError
from .._options import BACKENDS, check_device_index
from .._probe import Capabilities, device_info, host_available_bytes
from ._base import HOST_SHARE, Backend, default_headroom
from .device import DEVICE
from .host import HOST
from .managed import MANAGED
from .pinned import PINNED
from .system import SYSTEM

__all__ = ["Backend", "AUTO_ORDER", "HOST_SHARE", "default_headroom", "host_available_bytes", "get", "select", "names"]

# One module per backend, named after it; the option table holds the names
# and their order.
_BY_NAME = {b.name: b for b in (SYSTEM, MANAGED, PINNED, DEVICE, HOST)}
_ALL = {name: _BY_NAME[name] for name in BACKENDS}
#: The order ``backend="auto"`` tries on a machine with a GPU.
AUTO_ORDER = ("system", "managed", "pinned")


def names() -> tuple[str, ...]:
    return tuple(_ALL)


def get(name: str) -> Backend:
    try:
        return _ALL[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown backend {name!r}; choose one of 'auto', "
            + ", ".join(repr(n) for n in _ALL)
        ) from None


def select(name: str, caps: Capabilities, device: int = 0) -> Backend:
    """The backend to enable for ``name`` (``"auto"`` or a backend's name).

    Raises
    ------
    ValueError
        Unknown name or device index.
    BackendUnavailableError
        The machine cannot run the backend; the message says why.
    """
    check_device_index(device)
    info = device_info(caps, device) if caps.gpu else None
    if name == "auto":
        if not caps.gpu:
            return HOST
        reasons = []
        for candidate in AUTO_ORDER:
            why = _ALL[candidate].unavailable(caps, info)
            if why is None:
                return _ALL[candidate]
            reasons.append(f"{candidate}: {why}")
        raise BackendUnavailableError("no unified-memory backend can run here; " + "; ".join(reasons))
    backend = get(name)
    why = backend.unavailable(caps, info)
    if why is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run here: {why}")
    return backend
