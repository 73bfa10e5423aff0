"""GPU stress: a million allocation operations from 8 threads — NumPy arrays,
CuPy arrays, zero-copy hand-offs and kernels — every block checked, and the
statistics back where they started. UMP_STRESS_OPS scales it."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import ump
from _threads import run_threads, warm_numpy_random

pytestmark = pytest.mark.gpu

OPS = int(os.environ.get("UMP_STRESS_OPS", 1_000_000))


def _stress(gpu_backend):
    name, cupy = gpu_backend
    warm_numpy_random()
    gc.collect()
    ump.synchronize()
    before = ump.statistics()["numpy"]
    per_thread = OPS // 8
    done = [0] * 8

    def work(t):
        rng = np.random.default_rng(t)
        live = []  # (numpy array, CuPy view or None, value)
        ops = 0
        while ops < per_thread:
            r = rng.random()
            if live and (r < 0.35 or len(live) >= 200):  # bounded: far below the cap
                a, g, v = live.pop(int(rng.integers(len(live))))
                if g is not None:
                    assert cupy.asnumpy(g).ctypes.data == a.ctypes.data
                assert a[0] == v and a[-1] == v
                del a, g
                ops += 1
            elif live and r < 0.5:
                k = int(rng.integers(len(live)))
                a, g, v = live[k]
                g = cupy.asarray(a) if g is None else g
                assert g.data.ptr == a.ctypes.data
                g += 1  # a kernel on the shared memory
                live[k] = (a, g, v + 1)
                ops += 1
            elif r < 0.6:
                c = cupy.full(int(rng.integers(1, 50_000)), t, dtype=np.int32)
                assert int(c[-1]) == t
                del c
                ops += 2  # a CuPy allocation and its free
            else:
                n = int(rng.choice([1, 16, 300, 4_000, 60_000, 500_000]))
                v = int(rng.integers(0, 1000))
                a = np.full(n, v, dtype=np.int32)
                assert ump.kind_of(a) == name
                live.append((a, None, v))
                ops += 1
        for a, g, v in live:
            if g is not None:
                cupy.asnumpy(g)
            assert (a == v).all()
        done[t] = ops

    errors = run_threads(work)
    gc.collect()
    ump.synchronize()
    after = ump.statistics()["numpy"]
    pending = len(ump._enable.current().cupy.release)
    return errors, sum(done), pending, before, after


def test_million_operations(gpu_backend):
    errors, done, pending, before, after = _stress(gpu_backend)
    assert not errors, errors[:3]  # every block held its values, every address matched
    assert done >= OPS
    assert pending == 0  # every NumPy array CuPy used was released after the GPU finished
    # and the NumPy arena's live statistics are back where they started
    assert (after.current_bytes, after.current_count) == (before.current_bytes, before.current_count)


def test_device_pool_stress(gpu_caps):
    """The VMM pool under CuPy from 8 threads on 4 streams: mixed sizes and
    lifetimes, a kernel writes each array and its ends are checked before it
    is freed; the pool's used bytes return to where they started."""
    if not gpu_caps.devices[0].vmm_supported:
        pytest.skip("no VMM on this GPU")
    ump.enable("device", cap=4 << 30)
    import cupy

    pool = ump._enable.current().cupy.pool
    gc.collect()
    cupy.cuda.runtime.deviceSynchronize()
    before = pool.statistics()
    per_thread = OPS // 5 // 8
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)] + [cupy.cuda.Stream.null]

    def work(t):
        rng = np.random.default_rng(100 + t)
        live = []
        with streams[t % 4]:
            for _ in range(per_thread):
                if live and (rng.random() < 0.45 or len(live) >= 64):
                    g, v = live.pop(int(rng.integers(len(live))))
                    assert int(g[0]) == v and int(g[-1]) == v
                else:
                    n = int(rng.choice([1, 100, 5_000, 200_000, 1_500_000]))
                    v = int(rng.integers(1, 1 << 20))
                    live.append((cupy.full(n, v, dtype=cupy.int32), v))
            for g, v in live:
                assert int(g[0]) == v and int(g[-1]) == v

    errors = run_threads(work)
    assert not errors, errors[:3]
    gc.collect()
    cupy.cuda.runtime.deviceSynchronize()
    after = pool.statistics()
    assert (after.used_bytes, after.current_count) == (before.used_bytes, before.current_count)
    assert after.bad_frees == before.bad_frees and after.total_count > before.total_count + per_thread
