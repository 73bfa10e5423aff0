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
    alive = []  # (array, the value written into it)
    for i in range(1000):
        ump.enable()
        alive.append((np.full(100 + i % 50, i, dtype=np.int32), i))
        ump.disable()
        alive.append((np.full(3, -i, dtype=np.int32), -i))
        if len(alive) > 200:
            del alive[:100]
    assert len(alive) == 200
    for arr, value in alive:
        assert (arr == value).all(), (value, arr[:3])
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
    with pytest.raises(TypeError, match=rf"takes a NumPy or CuPy array, not '{type(obj).__name__}'"):
        ump.asarray(obj)
    # an array is the right argument: what is missing then is the GPU side
    with pytest.raises(ump.UmpError, match="'host' backend has no GPU side"):
        ump.asarray(np.zeros(3))


def test_enable_after_numpy_arrays_exist_and_disable_order(caps):
    """Arrays NumPy's own allocator made before enable() are freed by that
    allocator while ump is enabled; arrays ump made and outlive disable()
    go back to ump's arena when freed."""
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")
    foreign = _core.foreign_frees()
    early = [np.full(n, n, dtype=np.int64) for n in (10, 10_000, 1_000_000)]
    assert all(ump.kind_of(a) is None for a in early)
    with ump.enabled():
        arena = ump._enable.current().numpy_arena
        for a in early:
            assert (a == a.size).all()
        del a, early  # NumPy's default allocator frees them, not ump's hook
        assert _core.foreign_frees() == foreign
        late = np.full(1000, 7, dtype=np.int64)
        assert ump.kind_of(late) == "host"
        live = arena.statistics().current_count
    # disabled: the late array stays valid, and freeing it returns its block to ump's arena
    assert np._core.multiarray.get_handler_name() == "default_allocator"
    assert ump.kind_of(late) == "host" and (late == 7).all()
    del late
    assert arena.statistics().current_count == live - 1
    assert _core.foreign_frees() == foreign


def test_numpy_arrays_from_the_thread_cache_count_in_the_totals(host):
    """Small arrays come from the thread's cache after the first; each one
    still counts once in total_count and total_bytes."""
    before = ump.statistics()["numpy"]
    for _ in range(10_000):
        np.empty(64)  # 512 bytes, freed at once
    after = ump.statistics()["numpy"]
    assert after.total_count - before.total_count == 10_000
    assert after.total_bytes - before.total_bytes == 10_000 * 512
    assert (after.current_count, after.current_bytes) == (before.current_count, before.current_bytes)
    assert after.peak_count <= max(before.peak_count, before.current_count + 1)


@pytest.mark.parametrize("bad", [-1, 2**64, 2**64 + 100])
def test_sizes_a_c_integer_cannot_hold_are_refused(bad):
    """ctypes keeps the low 64 bits of an int: 2**64 + 100 bytes would become a
    100-byte block, a cap of 2**64 a cap of 0. (Device 22: an arena no other
    test uses.)"""
    arena = _core.Arena("host", _core.PROVIDER_HOST, 8 << 20, device=22)
    with pytest.raises(ValueError, match=rf"got {bad}\b"):
        arena.allocate(bad)
    with pytest.raises(ValueError, match=rf"got {bad}\b"):
        arena.set_cap(bad)
    assert arena.statistics().cap_bytes == 8 << 20
    with pytest.raises(ValueError, match=rf"got {bad}\b"):
        _core.Arena("host", _core.PROVIDER_HOST, bad, device=22)
    # checked before any CUDA call, so the same without a GPU
    with pytest.raises(ValueError, match=rf"got {bad}\b"):
        _core.prefetch(1 << 20, bad, -1, 0)
    with pytest.raises(ValueError, match=rf"got {bad}\b"):
        _core.advise(1 << 20, bad, _core.ADVICE["read_mostly"], 0)
    with pytest.raises(ValueError, match=rf"got {bad}\b"):
        _core.prefetch(bad, 4096, -1, 0)
    arena.set_cap(2**64 - 1)  # the largest cap a uint64_t holds
    assert arena.statistics().cap_bytes == 2**64 - 1


def test_the_os_running_out_of_memory_raises_out_of_memory_error():
    with pytest.raises(ump.OutOfMemoryError, match="UMP_ERR_NOMEM"):
        _core.check(_core.ERR_NOMEM, "allocating")
