"""Hardening through the Python API: stress, lifecycle, fork, bad input.

CPU-only (host backend); the GPU counterparts are in test_gpu_unified.py and
the C core's sanitizer runs in test_sanitizers.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ump
from _threads import run_threads, warm_numpy_random
from ump import _core


@pytest.fixture
def host(caps):
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")
    ump.enable()
    yield
    ump.disable()


def test_threads_churn_numpy_arrays_and_lose_nothing(host):
    warm_numpy_random()
    before = ump.statistics()["numpy"]

    def work(seed):
        rng = np.random.default_rng(seed)
        live = []
        for i in range(6000):
            r = rng.random()
            if live and r < 0.4:
                arr, value = live.pop(int(rng.integers(len(live))))
                assert arr[0] == value and arr[-1] == value
            elif live and r < 0.55:
                k = int(rng.integers(len(live)))
                arr, value = live[k]
                n = int(rng.integers(1, 200_000))
                arr.resize(n, refcheck=False)  # NumPy reallocs through the hook
                arr[:] = value
                live[k] = (arr, value)
            else:
                n = int(rng.choice([1, 7, 64, 700, 5_000, 70_000, 300_000]))
                value = (seed * 10_000 + i) % 250 + 1
                arr = np.full(n, value, dtype=np.uint8) if r < 0.8 else np.zeros(n, np.uint8) + value
                assert ump.kind_of(arr) == "host"
                live.append((arr, value))
        for arr, value in live:
            assert (arr == value).all()

    errors = run_threads(work)
    assert not errors, errors[:3]
    after = ump.statistics()["numpy"]
    assert (after.current_bytes, after.current_count) == (before.current_bytes, before.current_count)


def test_thousand_cycles_with_arrays_alive(caps):
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")
    foreign = _core.foreign_frees()
    alive = []
    for i in range(1000):
        ump.enable()
        alive.append(np.full(100 + i % 50, i, dtype=np.int32))
        ump.disable()
        alive.append(np.full(3, -i, dtype=np.int32))
        if len(alive) > 200:
            del alive[:100]
    assert all(a[0] in (i, -i) for a in alive for i in [abs(int(a[0]))])
    assert np._core.multiarray.get_handler_name() == "default_allocator"
    del alive
    ump.enable()
    stats = ump.statistics()["numpy"]
    ump.disable()
    assert stats.current_count < 50  # what the 1000 cycles left behind was freed
    assert _core.foreign_frees() == foreign


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_after_enable_keeps_numpy_working(host):
    parent = np.arange(100_000, dtype=np.int64)
    pid = os.fork()
    if pid == 0:
        try:
            ok = int(parent.sum()) == 100_000 * 99_999 // 2
            child = np.ones(1 << 20)  # new arrays: plain memory in the child
            ok &= ump.kind_of(child) is None and child.sum() == 1 << 20
            del parent  # freeing an inherited block only updates metadata
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ump.kind_of(parent) == "host" and parent[-1] == 99_999


@pytest.mark.parametrize("obj", [[1, 2], "array", 3, None])
def test_asarray_of_non_arrays(host, obj):
    # on the host backend the GPU side is missing; on a GPU it would be TypeError
    with pytest.raises((TypeError, ump.UmpError)):
        ump.asarray(obj)


def test_enable_after_numpy_arrays_exist_and_disable_order(host):
    # enable() while arrays from NumPy's own allocator are alive, then free them
    # while ump is active: each goes back to the allocator that made it
    early = [np.ones(n) for n in (10, 10_000, 1_000_000)]
    ump.disable()
    with ump.enabled():
        del early
        late = np.ones(1000)
    assert late.sum() == 1000
    del late
