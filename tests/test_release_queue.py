"""The order in which NumPy memory that CuPy viewed is released, on the CPU:
the queue's logic with a stand-in for the two CuPy calls it makes (entering
a device, waiting for it), which record what they were asked."""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import numpy as np
import pytest

from ump._release import ReleaseQueue


def _fake_cupy(log, graph=None):
    """``graph.capturing``: whether the current stream captures a graph (never if None)."""
    @contextlib.contextmanager
    def device(d):
        log.append(("enter", d))
        yield

    # no device is current, so every wait enters the device it waits for
    runtime = types.SimpleNamespace(deviceSynchronize=lambda: log.append(("sync",)), getDevice=lambda: -1,
                                    getDeviceCount=lambda: 1,
                                    streamIsCapturing=lambda ptr: bool(graph and graph.capturing))
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=device, runtime=runtime, get_current_stream=lambda: types.SimpleNamespace(ptr=0)))


def test_an_array_is_released_only_by_a_wait_begun_after_it_was_deferred():
    queue = ReleaseQueue(_fake_cupy([]))
    a, b = np.ones(10), np.ones(20)
    queue.defer(a, 0)
    mark = queue.mark()  # a device-wide wait begins ...
    queue.defer(b, 0)  # ... while another view is dropped
    queue.synchronized(0, mark)
    assert len(queue) == 1  # b was deferred after the wait began: kept
    queue.synchronized(0, queue.mark())
    assert len(queue) == 0


def test_a_wait_on_one_device_releases_nothing_of_another():
    queue = ReleaseQueue(_fake_cupy([]))
    queue.defer(np.ones(4), 0)
    queue.defer(np.ones(4), 1)
    queue.synchronized(1, queue.mark())
    assert len(queue) == 1 and queue._pending[0]


def test_on_several_gpus_a_wait_covers_every_gpu_with_work():
    # CuPy copies across devices with a kernel on the current device, which
    # writes the other device's memory: waiting for the array's device alone
    # would let the host read before the copy ends.
    log = []
    queue = ReleaseQueue(_fake_cupy(log), device_count=3, active_devices=lambda: [0, 2])
    queue.defer(np.ones(4), 0)
    queue.defer(np.ones(4), 1)
    queue.wait_for(1)
    assert log == [("enter", 0), ("sync",), ("enter", 1), ("sync",), ("enter", 2), ("sync",)]
    assert len(queue) == 0  # every device waited for: all released


def test_on_one_gpu_a_wait_asks_for_no_other():
    log, counts = [], []
    cupy = _fake_cupy(log)
    cupy.cuda.runtime.getDeviceCount = lambda: counts.append(1) or 1
    cupy.cuda.runtime.getDevice = lambda: 0  # the one GPU is the current one
    queue = ReleaseQueue(cupy, active_devices=lambda: pytest.fail("asked on one GPU"))
    queue.wait_for(0)
    queue.wait_for(0)
    queue.defer(np.ones(4), 0)
    queue.wait_for(0)  # a release to make: the queue's own wait
    assert log == [("sync",)] * 3 and len(queue) == 0
    assert counts == [1]  # the device count is read once


def test_with_nothing_deferred_a_wait_is_the_device_wait_alone():
    # A solver reads a scalar each step: with nothing to release, the wait
    # neither takes the queue's lock nor numbers anything.
    log = []
    cupy = _fake_cupy(log)
    cupy.cuda.runtime.getDevice = lambda: 0
    queue = ReleaseQueue(cupy)

    class NoLock:
        def __enter__(self):
            pytest.fail("the lock was taken with nothing deferred")

        def __exit__(self, *exc):
            return False

        def acquire(self, blocking=True):
            pytest.fail("the lock was taken with nothing deferred")

    lock, queue._lock = queue._lock, NoLock()
    queue.wait_for(0)
    queue.wait_for()
    assert log == [("sync",)] * 2
    queue._lock = lock
    queue.defer(np.ones(4), 0)  # one deferred: the next wait releases it
    queue.wait_for(0)
    assert log == [("sync",)] * 3 and len(queue) == 0


def test_the_queues_wait_passes_the_programs_wait_wrapper_uncounted():
    """While enabled, ump times the program's own device waits through a
    wrapper of CuPy's call (``wrap_waits``); the queue's wait calls CuPy's
    under ump's wrapper directly, and calls another library's wrapper
    inside ``OwnWaits``, so that ump's wrapper under it counts nothing."""
    from ump._cupy_compat import waiting_itself

    log, seen = [], []
    cupy = _fake_cupy(log)
    runtime = cupy.cuda.runtime
    device_wait = runtime.deviceSynchronize
    queue = ReleaseQueue(cupy)

    def timed():
        pytest.fail("ump's own wait went through the wrapper that times the program's")

    timed.ump_wrapped = (timed, device_wait)
    runtime.deviceSynchronize = timed
    queue.wait_for(0)

    @functools.wraps(timed)  # copies ump_wrapped, as another library's wrapper would
    def traced():
        seen.append(waiting_itself())
        device_wait()

    runtime.deviceSynchronize = traced
    queue.wait_for(0)
    assert log == [("sync",)] * 2 and seen == [True] and not waiting_itself()


def test_bytes_only_the_queue_holds_drain_every_device():
    log = []
    queue = ReleaseQueue(_fake_cupy(log))
    queue.MAX_PENDING_BYTES = 1000
    big, other = np.ones(100), np.ones(100)  # 800 bytes each
    for _ in range(5):
        queue.defer(big, 0)  # the same array, dropped again and again: held once
    queue.defer(other, 1)
    # The program still holds both: a drain would free nothing.
    assert log == [] and len(queue) == 6 and queue._bytes == 1600
    del big, other  # now only the queue holds 1600 bytes
    queue.defer(np.ones(1), 0)
    assert log == [("enter", 0), ("sync",), ("enter", 1), ("sync",)]
    assert len(queue) == 0 and queue._bytes == 0 and not queue._held


def test_too_many_entries_drain():
    log = []
    queue = ReleaseQueue(_fake_cupy(log))
    queue.MAX_PENDING = 3
    arrays = [np.ones(1) for _ in range(4)]
    for a in arrays:
        queue.defer(a, 0)
    assert log == [("enter", 0), ("sync",)] and len(queue) == 0


def test_views_count_as_the_array_that_owns_their_memory():
    log = []
    queue = ReleaseQueue(_fake_cupy(log))
    queue.MAX_PENDING_BYTES = 1000
    x = np.ones((20, 10))  # 1600 bytes the program holds
    for _ in range(3):
        queue.defer(x.T, 0)  # a temporary view, dropped by CuPy and by the program
        queue.defer(x[::2], 0)
    # Held once, by its owner: waiting for the device would free nothing.
    assert log == [] and len(queue._held) == 1 and queue._bytes == x.nbytes
    y = np.ones(1)
    queue.defer(y, 0)  # a new array: counted again, x is still held
    del x  # now only the queue holds x, but no new array comes to say so
    for _ in range(queue.RECOUNT_EVERY - 1):
        queue.defer(y, 0)
    assert log == []  # counting walks every array: not at each view
    queue.defer(y, 0)
    assert log == [("enter", 0), ("sync",)] and not queue._held


def test_a_drain_while_a_graph_is_captured_waits_for_nothing_and_keeps_the_arrays():
    # A device-wide wait then would invalidate the capture (CuPy's
    # test_graph.py: test_stream_capture_failure3 and 5).
    log, graph = [], types.SimpleNamespace(capturing=True)
    queue = ReleaseQueue(_fake_cupy(log, graph))
    queue.defer(np.ones(4), 0)
    queue.drain()
    assert log == [] and len(queue) == 1
    graph.capturing = False
    queue.drain()
    assert ("sync",) in log and len(queue) == 0


@pytest.mark.parametrize("on_free", [None, "tells", "raises"])
def test_a_block_the_pool_gives_back_is_waited_for_then_freed_whatever_the_placement_does(
        monkeypatch, on_free):
    from ump import _cupy_alloc

    log = []

    def told(ptr):
        log.append(("on_free", ptr))
        if on_free == "raises":
            raise TypeError("a placement bug")

    monkeypatch.setattr(_cupy_alloc._core, "_arena_free", lambda ptr: log.append(("free", ptr)))
    runtime = types.SimpleNamespace(deviceSynchronize=lambda: log.append(("sync",)))
    chunk = _cupy_alloc._Chunk(0x1000, runtime, None if on_free is None else told)
    del chunk
    told_first = [] if on_free is None else [("on_free", 0x1000)]
    assert log == told_first + [("sync",), ("free", 0x1000)]


def _round_trip(a, queue):
    """What ``cupy.asnumpy(cupy.asarray(a))`` returns under ump: a host view
    whose base holds the CuPy view, whose memory holds a Lease on ``a``."""
    from ump._release import Lease
    from ump._cupy_hook import _Export

    return np.asarray(_Export(dict(a.__array_interface__), Lease(a, queue, 0)))


def _finishes(target, *args, timeout=5.0):
    worker = threading.Thread(target=target, args=args, daemon=True)
    worker.start()
    worker.join(timeout)
    return not worker.is_alive()


def test_the_queues_and_the_pools_waits_are_umps_own(monkeypatch):
    """Waits ump makes to release memory run inside ``OwnWaits``: the
    program's waits, which ump times for the placement policy, would
    otherwise count them too."""
    from ump import _cupy_alloc
    from ump._cupy_compat import waiting_itself

    inside = []
    cupy = _fake_cupy([])
    cupy.cuda.runtime.deviceSynchronize = lambda: inside.append(waiting_itself())
    queue = ReleaseQueue(cupy)
    queue.defer(np.ones(4), 0)
    queue.drain()
    monkeypatch.setattr(_cupy_alloc._core, "_arena_free", lambda ptr: None)
    chunk = _cupy_alloc._Chunk(0x1000, cupy.cuda.runtime)
    del chunk  # the pool gives the block back: a wait, then the free
    assert inside == [True, True] and not waiting_itself()


def test_releasing_host_views_of_round_trips_hands_the_queue_more_without_a_hang():
    # In-place round trips: each array released frees a host view whose CuPy
    # view had leased another NumPy array; that Lease hands it to the queue
    # while the queue is releasing.
    from ump._release import Lease

    queue = ReleaseQueue(_fake_cupy([]))
    first, second = _round_trip(np.ones(8), queue), _round_trip(np.ones(8), queue)
    Lease(first, queue, 0), Lease(second, queue, 0)  # handed to CuPy again, then dropped
    del first, second
    assert len(queue) == 2
    assert _finishes(queue.wait_for, 0), "the release deadlocked on the queue's own lock"
    # The two arrays the host views had leased came in during the release:
    # they wait for the next wait, which begins after they were handed over.
    assert len(queue) == 2
    assert _finishes(queue.wait_for, 0) and len(queue) == 0


def test_a_view_dropped_while_the_queue_is_locked_is_queued_by_the_next_call():
    # A collection inside any allocation can drop a CuPy view on the thread
    # that holds the queue's lock.
    from ump._release import Lease

    queue = ReleaseQueue(_fake_cupy([]))
    a = np.ones(8)

    def drop_under_the_lock():
        with queue._lock:
            Lease(a, queue, 0)  # dropped at once: Lease.__del__ runs here

    assert _finishes(drop_under_the_lock)
    assert len(queue) == 1 and not queue._held  # handed over, not yet queued
    mark = queue.mark()  # a wait that begins now covers it
    assert id(a) in queue._held
    queue.synchronized(0, mark)
    assert len(queue) == 0
