"""The placement's uploads on a real GPU with real CuPy: a NumPy block
that only CuPy's view holds moves at the next allocation, and the watch on
CuPy's allocations goes off once nothing needs it.

Run with CUPY_ENABLE_UMP=1 on a CUDA machine; skipped elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

import ump
from _gpu import require_backend

pytestmark = pytest.mark.gpu


def test_placement_auto_moves_an_upload_at_the_next_allocation(gpu_caps):
    """``g = cupy.asarray(a); del a``: only CuPy's view holds the NumPy
    array, and the next kernel's output allocation moves the block to the
    GPU, before any wait; the export brings it back at the same address."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    a = np.ones(16 << 20, dtype=np.float32)
    addr = a.ctypes.data
    _, base, size = ump._core.lookup(addr)
    g = cupy.asarray(a)
    del a
    assert placement.state(base, size).on_gpu is None
    y = g * 2
    assert placement.state(base, size).on_gpu == 0 and placement.state(base, size).synced
    assert float(y[-1]) == 2.0 and float(y.sum()) == 2.0 * y.size
    back = cupy.asnumpy(g)
    assert back.ctypes.data == addr and back[-1] == 1.0 and placement.state(base, size).on_gpu is None


def test_placement_auto_switches_the_watch_off_when_a_followed_view_is_gone(gpu_caps):
    """``float(cupy.asarray(a).sum())`` with ``a`` held: CuPy's allocations
    pass through ump while the block is asked about, and the view is gone by
    the read, whose wait stops following the block. The watch goes off
    with it: CuPy's allocator is its pool's again, not ump's Python call
    on every allocation for the rest of the process."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    hook = ump._enable.current().cupy
    placement = hook.placement
    warm = cupy.ones(8, dtype=np.float32)
    warm *= 2
    float(warm.sum())
    assert cupy.cuda.get_allocator() == hook.pool.malloc
    a = np.ones(16 << 20, dtype=np.float32)
    _, base, size = ump._core.lookup(a.ctypes.data)
    assert float(cupy.asarray(a).sum()) == float(a.size)
    assert (base, size) not in placement.pending and not placement.uploads
    assert cupy.cuda.get_allocator() == hook.pool.malloc  # the watch is off again
    y = cupy.arange(4, dtype=np.float32) * 2  # allocations still work, from the pool
    assert float(y[-1]) == 6.0
