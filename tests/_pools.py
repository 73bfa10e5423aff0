"""The VMM pools a test works in, checked when the test ends, and how a test
writes and reads their memory on either physical layer."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ump import _core
from ump._vmm import VMMPool


def _checked(p: VMMPool):
    """For a fixture to ``yield from``: ``p``; the test fails if it leaves a
    block, buffer or view open, and the pool is closed (pools are a
    process-wide resource, 16 at most)."""
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


def emulated_pool(reserve: int):
    """An emulated pool (memfd mappings): runs on every machine."""
    yield from _checked(VMMPool(emulate=True, reserve=reserve))


def device_pool(cupy, reserve: int):
    """A pool of GPU 0's memory (cuMemCreate / cuMemMap)."""
    p = VMMPool(0, reserve=reserve)
    try:
        yield from _checked(p)
    finally:
        cupy.cuda.runtime.deviceSynchronize()


def fill(pool: VMMPool, ptr: int, n: int, byte: int) -> None:
    """Write ``byte`` over ``[ptr, ptr+n)`` of the pool's memory."""
    if pool.emulated:
        ctypes.memset(ptr, byte, n)
    else:
        import cupy

        cupy.cuda.runtime.memset(ptr, byte, n)
        cupy.cuda.runtime.deviceSynchronize()


def holds(pool: VMMPool, ptr: int, n: int, byte: int) -> bool:
    """Whether every byte of ``[ptr, ptr+n)`` is ``byte``."""
    if pool.emulated:
        return ctypes.string_at(ptr, n) == bytes([byte]) * n
    import cupy

    host = np.empty(n, dtype=np.uint8)
    cupy.cuda.runtime.memcpy(host.ctypes.data, ptr, n, cupy.cuda.runtime.memcpyDeviceToHost)
    return bool((host == byte).all())
