"""Helpers for the GPU tests."""

from __future__ import annotations

import pytest


def require_backend(caps, name):
    """Skip, with the reason, where the machine cannot run backend ``name``."""
    from ump import backends

    why = backends.get(name).unavailable(caps, caps.devices[0])
    if why is not None:
        pytest.skip(f"backend {name} cannot run here: {why}")
