"""fork() while another thread is inside the C core: the child must never
inherit a lock held by a thread that does not exist in it.

The VMM pool runs on its emulated physical layer (memfd), so this runs on
every machine. A fault-injection delay holds the pool's lock open for as long
as the test needs, and the injection point tells a pipe when it is reached,
which makes the race deterministic.
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
import types

import pytest

from _fork import CHILD_TIMEOUT, fork, wait
from ump import _core
from ump._vmm import VMMPool

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

MiB = 1 << 20


def test_child_forked_while_a_thread_holds_a_pool_lock_finishes():
    pool = VMMPool(emulate=True, reserve=1 << 30)
    inherited = pool.allocate(MiB)
    ctypes.memset(inherited, 5, MiB)
    foreign = ctypes.create_string_buffer(4096)  # memory ump does not own
    grown = []

    def hold_the_pool_lock():
        # 8 MiB beyond the first granule: a handle created, mapped and given
        # access, each step a fault-injection point that sleeps under the lock.
        grown.append(pool.allocate(8 * MiB))

    reached, signal = os.pipe()
    _core.fault_delay(400_000)
    _core.fault_signal(signal)  # the first injection point tells the pipe
    try:
        thread = threading.Thread(target=hold_the_pool_lock)
        thread.start()
        ready, _, _ = select.select([reached], [], [], CHILD_TIMEOUT)
        assert ready, "the thread never reached a fault-injection point"
        os.read(reached, 1)  # the thread is inside ump_vmm_alloc, lock held, asleep
        pid = fork()
        if pid == 0:
            code = 1
            try:
                _core.fault_delay(0)
                ok = _core.is_forked_child() == 1
                ok &= ctypes.string_at(inherited, 4) == b"\x05" * 4
                ok &= _core.lookup(ctypes.addressof(foreign))[0] is None  # every pool's lock
                pool.deallocate(inherited)
                ok &= _core.lookup(inherited)[0] is None
                code = 0 if ok else 1
            finally:
                os._exit(code)
        code = wait(pid)
        thread.join()
    finally:
        _core.fault_delay(0)
        _core.fault_signal(-1)
        os.close(reached)
        os.close(signal)
    assert code is not None, f"the forked child hung for {CHILD_TIMEOUT:.0f} s on a lock it inherited held"
    assert code == 0
    assert _core.is_forked_child() == 0
    assert _core.lookup(inherited)[0] == "host"  # the parent's block is untouched
    pool.deallocate(grown[0])
    pool.deallocate(inherited)
    pool.close()


class _FakeCupyHook:
    """What disable() reaches of a CuPy hook, recording whether its
    uninstall may call CUDA."""

    def __init__(self, calls):
        self.calls = calls
        self.pool = types.SimpleNamespace(used_bytes=lambda: 0)

    def uninstall(self, cuda=True):
        self.calls.append(f"uninstall(cuda={cuda})")


def test_a_cupy_hook_uninstalled_without_cuda_only_puts_cupy_back():
    # Each of a full uninstall's other steps calls CUDA: the placement's
    # advice, the wait for the device, the pool's frees, and freeing the
    # pinned buffers scalar conversions copy into.
    from ump import _cupy_hook
    from ump._cupy_hook import CupyHook

    from ump._cupy_alloc import CupyAllocator

    calls = []
    hook = object.__new__(CupyHook)
    hook.allocator = object.__new__(CupyAllocator)
    hook.allocator.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        set_allocator=lambda allocator: calls.append(f"set_allocator({allocator})")))
    hook.allocator.saved = "CuPy's allocator"
    hook.patches = types.SimpleNamespace(restore=lambda: calls.append("patches restored"))
    hook.placement = types.SimpleNamespace(close=lambda: calls.append("placement closed"))
    hook.release = types.SimpleNamespace(wait_for=lambda: calls.append("device waited for"))
    hook.pool = types.SimpleNamespace(free_all_blocks=lambda: calls.append("pool freed"))

    class Pinned:
        def __del__(self):
            calls.append("pinned freed")

    hook._element_buffers = [Pinned()]
    hook.uninstall(cuda=False)
    assert calls == ["set_allocator(CuPy's allocator)", "patches restored"]
    assert hook._element_buffers == [] and isinstance(_cupy_hook._KEPT_IN_CHILD[-1], Pinned)
    del _cupy_hook._KEPT_IN_CHILD[-1]
    calls.clear()
    hook._element_buffers = [Pinned()]
    hook.uninstall()
    assert calls == ["set_allocator(CuPy's allocator)", "pinned freed", "placement closed",
                     "patches restored", "device waited for", "pool freed"]


def test_disable_in_a_forked_child_restores_the_allocators_without_cuda(caps):
    """The guide: a forked child never calls CUDA. disable() there puts
    CuPy's allocator and methods and NumPy's handler back without the
    device waits of a full uninstall; the parent's hook is untouched."""
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")
    import ump
    from ump import _enable
    from ump._numpy_hook import handler_name

    ump.enable("host")
    calls = []
    state = _enable.current()
    state.cupy = _FakeCupyHook(calls)
    try:
        pid = fork()
        if pid == 0:
            code = 1
            try:
                checks = (
                    ump.disable() is True,
                    calls == ["uninstall(cuda=False)"],
                    handler_name() == "default_allocator" and not ump.is_enabled(),
                )
                code = next((i + 10 for i, ok in enumerate(checks) if not ok), 0)
            finally:
                os._exit(code)
        code = wait(pid)
    finally:
        state.cupy = None
    assert code == 0, {10: "disable() failed", 11: "the child's uninstall may call CUDA",
                       12: "NumPy's handler was not restored"}.get(code, code)
    assert calls == [] and ump.is_enabled()  # the parent's state is its own
