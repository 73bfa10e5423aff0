"""CuPy's memory on GPUs other than the enabled one, on the CPU: which arena
and budget an allocation under ``cupy.cuda.Device(k)`` takes from. Host
arenas stand in for the GPU's; a stand-in CuPy records the device each
allocation is labelled with. The GPU side (contexts, the device that
cudaPointerGetAttributes names) is tests/test_gpu_startup.py's."""

from __future__ import annotations

import threading
import types

import pytest

from ump import _core, _devices, _enable, backends
from ump._cupy_alloc import UnifiedUpstream
from ump._release import ReleaseQueue
from ump._cupy_compat import out_of_memory_error

MiB = 1 << 20


class Unowned:
    def __init__(self, ptr, size, owner, device):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device


class CupyOutOfMemory(MemoryError):
    pass


def _fake_cupy(current, graph=None):
    """``graph.capturing``: whether the current stream captures a graph (never if None)."""
    memory = types.SimpleNamespace(UnownedMemory=Unowned, MemoryPointer=lambda mem, offset: mem,
                                   OutOfMemoryError=CupyOutOfMemory)
    runtime = types.SimpleNamespace(getDevice=lambda: current[0], deviceSynchronize=lambda: None,
                                    getDeviceCount=lambda: 2,
                                    streamIsCapturing=lambda ptr: bool(graph and graph.capturing))
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        memory=memory, runtime=runtime, get_current_stream=lambda: types.SimpleNamespace(ptr=0)))


class _Pool:
    freed = 0

    def free_all_blocks(self):
        self.freed += 1


def _upstream(current, main, arena_for, graph=None):
    cupy = _fake_cupy(current, graph)
    up = UnifiedUpstream(cupy, main, "host", ReleaseQueue(cupy, active_devices=lambda: [0, 1]),
                         out_of_memory_error(cupy), spill=False, device=0, arena_for=arena_for)
    up.pool = _Pool()
    return up


def test_an_allocation_under_another_device_takes_that_devices_arena():
    main = _core.Arena("host", _core.PROVIDER_HOST, 64 * MiB, cupy_side=True, device=10)
    second = _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, cupy_side=True, device=11)
    asked = []
    current = [0]
    up = _upstream(current, main, lambda d: asked.append(d) or second)
    on_main = up(6 * MiB)  # large blocks: a chunk of their own size
    current[0] = 1
    on_second = up(6 * MiB)
    assert asked == [1] and on_main.device_id == 0 and on_second.device_id == 1
    assert main.statistics().current_count == 1 and second.statistics().current_count == 1
    with pytest.raises(CupyOutOfMemory, match="budget of 8388608 bytes"):
        up(6 * MiB)  # device 1's budget, not the main one's, is what runs out
    for mem in (on_main, on_second):
        _core._arena_free(mem.ptr)
    main.trim()
    second.trim()


def test_one_gpu_never_asks_for_another_arena():
    main = _core.Arena("host", _core.PROVIDER_HOST, 64 * MiB, cupy_side=True, device=10)
    up = _upstream([0], main, lambda d: pytest.fail("asked for another device's arena"))
    mem = up(6 * MiB)
    assert mem.device_id == 0
    _core._arena_free(mem.ptr)


def test_out_of_memory_while_a_graph_is_captured_keeps_the_cached_blocks():
    # Freeing a cached chunk waits for the device, which would invalidate
    # the capture: the allocation fails without it.
    main = _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, cupy_side=True, device=10)
    graph = types.SimpleNamespace(capturing=True)
    up = _upstream([0], main, None, graph)
    held = up(6 * MiB)
    with pytest.raises(CupyOutOfMemory, match="budget of 8388608 bytes"):
        up(6 * MiB)
    assert up.pool.freed == 0
    graph.capturing = False
    with pytest.raises(CupyOutOfMemory):
        up(6 * MiB)
    assert up.pool.freed == 2  # outside a capture: before each retry, as CuPy's pool does
    _core._arena_free(held.ptr)
    main.trim()


def test_out_of_memory_names_this_threads_failure_when_another_thread_allocated_meanwhile():
    # The arena's status is per thread: another thread's allocation between
    # this one's failure and its error must not change the name it reports.
    main = _core.Arena("host", _core.PROVIDER_HOST, 64 * MiB, cupy_side=True, device=10)
    up = _upstream([0], main, None)
    others = []
    statistics = main.statistics

    def statistics_while_another_thread_allocates():
        _core.fault_inject(0, 0)
        worker = threading.Thread(target=lambda: others.append(up(6 * MiB)))
        worker.start()
        worker.join()
        return statistics()

    main.statistics = statistics_while_another_thread_allocates
    _core.fault_inject(0, -1)  # every provider call fails: UMP_ERR_INJECTED
    try:
        with pytest.raises(CupyOutOfMemory) as caught:
            up(6 * MiB)
    finally:
        _core.fault_inject(0, 0)
    assert len(others) == 1 and caught.value.cuda_error == "UMP_ERR_INJECTED"
    _core._arena_free(others[0].ptr)
    main.trim()


@pytest.fixture
def contexts(monkeypatch):
    """Device contexts without a GPU: device k's context is 0x1000 + k, and
    it has k + 1 GiB free of 8 GiB. (No chunk is made: no CUDA call.)"""
    monkeypatch.setattr(_devices, "context", lambda d: (0x1000 + d, (d + 1) << 30, 8 << 30))
    monkeypatch.setattr(_devices, "_cupy_arenas", {})


def test_managed_memory_of_another_gpu_has_that_gpus_budget(contexts):
    opts = _enable.Options(headroom=256 * MiB)
    main = _core.Arena("managed", _core.PROVIDER_MANAGED, 4 << 30, cupy_side=True)
    arena = _enable._cupy_arena_on(backends.MANAGED, opts, main, 2)
    assert arena.device == 2 and arena.statistics().cap_bytes == (3 << 30) - 256 * MiB
    assert _enable._cupy_arena_on(backends.MANAGED, opts, main, 2) is arena  # made once
    assert main.statistics().cap_bytes == 4 << 30  # the main budget is untouched


def test_pinned_memory_of_another_gpu_shares_the_hosts_budget(contexts):
    main = _core.Arena("pinned", _core.PROVIDER_PINNED, 5 << 30, cupy_side=True)
    arena = _enable._cupy_arena_on(backends.PINNED, _enable.Options(), main, 1)
    assert arena.id != main.id and arena.device == -1 and arena.statistics().cap_bytes == 5 << 30


def test_system_memory_has_no_context_to_tell_devices_apart(contexts):
    main = _core.Arena("system", _core.PROVIDER_HOST, 64 * MiB, cupy_side=True, device=12)
    assert _enable._cupy_arena_on(backends.SYSTEM, _enable.Options(), main, 1) is main


def test_a_gpu_without_room_makes_cupy_run_out_of_memory_there(contexts, monkeypatch):
    monkeypatch.setattr(_devices, "context", lambda d: (0x1000 + d, 64 * MiB, 8 << 30))
    main = _core.Arena("managed", _core.PROVIDER_MANAGED, 4 << 30, cupy_side=True)
    arena = _enable._cupy_arena_on(backends.MANAGED, _enable.Options(), main, 3)
    assert arena.device == 3 and arena.statistics().cap_bytes == 0  # an allocation fails as out of memory
