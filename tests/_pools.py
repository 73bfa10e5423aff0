"""The emulated VMM pool a test works in, checked when the test ends."""

from __future__ import annotations

import pytest

from ump import _core
from ump._vmm import VMMPool


def emulated_pool(reserve: int):
    """For a fixture to ``yield from``: an emulated pool; the test fails if
    it leaves a block, buffer or view open, and the pool is closed (pools
    are a process-wide resource, 16 at most)."""
    p = VMMPool(emulate=True, reserve=reserve)
    yield p
    _core.fault_inject(0, 0)
    if p._closed:
        return
    st = p.statistics()
    left = {"block(s)": st.current_count, "buffer bytes": st.buffer_bytes, "view(s)": st.views,
            "shared bytes": st.shared_bytes, "imported bytes": st.imported_bytes}
    if any(left.values()):
        pytest.fail("the test left " + ", ".join(f"{n} {what}" for what, n in left.items() if n) + " open")
    p.close()
