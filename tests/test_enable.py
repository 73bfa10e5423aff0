"""enable()/disable(), the NumPy hook, threads, errors: on any machine.

Without a GPU ``backend="auto"`` picks ``host``; with one, these tests use
``host`` only where the machine has no GPU and skip otherwise.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import ump
from ump import _core, _cupy_compat, _devices, _driver, _enable, _numpy_hook, _probe, backends

handler_name = np._core.multiarray.get_handler_name


@pytest.fixture
def cpu_only(caps):
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")


def test_enable_registers_numpy_and_disable_restores(cpu_only):
    before = np.arange(1 << 18)
    assert ump.kind_of(before) is None and not ump.is_enabled()
    assert ump.enable() == "host" and ump.backend() == "host"
    a = np.empty(1 << 20)
    assert ump.kind_of(a) == "host" and handler_name(a) == "ump" and _numpy_hook.owns(a)
    assert not _numpy_hook.owns(before)
    assert ump.disable() is True
    assert handler_name() == "default_allocator"
    after = np.ones(1 << 20)
    assert ump.kind_of(after) is None
    # arrays from both sides of the switch keep working and free through their own handler
    a[:] = 3
    assert a.sum() == 3 * (1 << 20) and before.sum() == (1 << 18) * ((1 << 18) - 1) // 2
    del a, before


def test_arrays_in_new_threads_are_ump(cpu_only):
    ump.enable()
    seen = {}

    def make(key):
        arr = np.empty(1 << 16)
        seen[key] = (ump.kind_of(arr), handler_name())

    t = threading.Thread(target=make, args=("thread",))
    t.start()
    t.join()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(make, ["pool0", "pool1"]))
    assert seen == {k: ("host", "ump") for k in ("thread", "pool0", "pool1")}
    ump.disable()
    t = threading.Thread(target=make, args=("after",))
    t.start()
    t.join()
    assert seen["after"] == (None, "default_allocator")


def test_enabled_context_manager(cpu_only):
    with ump.enabled() as name:
        assert name == "host" and ump.kind_of(np.zeros(1000)) == "host"
    assert not ump.is_enabled() and handler_name() == "default_allocator"


def test_enable_twice_and_disable_twice(cpu_only):
    assert ump.enable() == "host"
    assert ump.enable() == "host"  # the same request again: nothing happens
    with pytest.raises(ump.UmpError, match=r"already enabled .*cap None -> 4194304"):
        ump.enable(cap=4 << 20)
    assert ump.disable() is True
    assert ump.disable() is False  # nothing to undo


def test_many_cycles_leak_nothing(cpu_only):
    foreign = _core.foreign_frees()
    keep = []
    for i in range(300):
        with ump.enabled():
            keep.append(np.full(1000 + i, i, dtype=np.int64))
        keep.append(np.full(10, i))
    assert all(int(k[0]) == i // 2 for i, k in enumerate(keep))
    with ump.enabled():
        stats = ump.statistics()["numpy"]
    assert stats.current_count >= 300
    del keep
    with ump.enabled():
        assert ump.statistics()["numpy"].current_count < 300
    assert _core.foreign_frees() == foreign  # every free found its block


def test_cap_exhaustion_falls_back(cpu_only):
    ump.enable(cap=16 << 20)
    ump.trim()
    small = [np.ones(1 << 20, dtype=np.uint8) for _ in range(4)]
    big = np.ones(64 << 20, dtype=np.uint8)
    assert all(ump.kind_of(s) == "host" for s in small)
    assert ump.kind_of(big) is None and int(big[::4096].sum()) == (64 << 20) // 4096
    assert ump.statistics()["fallback"].current_count >= 1


@pytest.mark.parametrize("options,error", [
    ({"cap": -1}, ValueError), ({"cap": 0}, ValueError), ({"cap": 1.5}, ValueError),
    ({"cap": "lots"}, ValueError), ({"cap": [1]}, TypeError), ({"cap": True}, TypeError), ({"cap": 1 << 70}, ValueError),
    ({"device": -1}, ValueError), ({"device": "zero"}, ValueError), ({"device": 0.0}, ValueError), ({"placement": "gpu"}, ValueError),
    ({"sync": "never"}, ValueError), ({"prefetch_min": -5}, ValueError), ({"colour": 1}, TypeError),
])
def test_bad_options_are_rejected(options, error):
    with pytest.raises(error):
        ump.enable(**options)
    assert not ump.is_enabled()


def test_unknown_and_unavailable_backends(caps):
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        ump.enable("gpu")
    if not caps.gpu:
        with pytest.raises(ump.BackendUnavailableError, match="no GPU"):
            ump.enable("managed")
        with pytest.raises(ump.BackendUnavailableError, match="system"):
            ump.enable("system")
    elif not caps.devices[0].pageable_memory_access:
        with pytest.raises(ump.BackendUnavailableError, match="pageable memory access is 0"):
            ump.enable("system")
    if caps.gpu:
        with pytest.raises(ValueError, match="device 99 does not exist"):
            ump.enable(device=99)
    assert not ump.is_enabled()


@pytest.mark.parametrize("garbage", ["abc", 1.5, None, object(), [1, 2], True])
def test_kind_of_garbage(garbage):
    with pytest.raises(TypeError):
        ump.kind_of(garbage)


def test_kind_of_addresses():
    with pytest.raises(ValueError):
        ump.kind_of(-4)
    assert ump.kind_of(0) is None and ump.kind_of(2**64 + 5) is None
    assert ump.kind_of(id(object())) is None


def test_gpu_only_functions_need_a_gpu_backend(cpu_only):
    with pytest.raises(ump.UmpError, match="not enabled"):
        ump.asarray(np.zeros(3))
    ump.enable()
    with pytest.raises(ump.UmpError, match="no GPU side"):
        ump.asnumpy(np.zeros(3))
    with pytest.raises(ump.UmpError, match="no GPU side"):
        ump.prefetch(np.zeros(3))


def test_probe_without_gpu_never_raises(caps):
    assert isinstance(caps, ump.Capabilities)
    if not caps.gpu:
        assert caps.reason and caps.devices == ()
    assert caps.numpy_version == np.__version__
    assert caps.numpy_allocator_version is not None


def test_import_creates_no_context_and_imports_no_cupy(tmp_path):
    code = "import sys, ump; ump.probe(); print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path)
    assert out.stdout.strip() == "False"


def test_info_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ump", "info"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "enable() would choose:" in out.stdout and "backend host:" in out.stdout


def test_public_api_is_pinned():
    assert sorted(ump.__all__) == sorted([
        "__version__", "BackendUnavailableError", "Capabilities", "DeviceInfo", "ExportHandle",
        "GrowableBuffer", "MappedMemory", "Options", "OutOfMemoryError", "Statistics", "UmpError",
        "UmpWarning", "VMMPool", "VMMStatistics", "ViewTimes", "advise", "asarray", "asnumpy", "backend",
        "disable", "enable", "enabled", "import_handle", "is_enabled", "kind_of", "migrate", "prefetch",
        "probe", "statistics", "synchronize", "trim"])
    from ump import share

    assert sorted(share.__all__) == ["Connection", "ExportHandle", "Listener", "connect",
                                         "import_handle", "listen"]
    assert issubclass(ump.OutOfMemoryError, MemoryError) and issubclass(ump.OutOfMemoryError, ump.UmpError)


def test_extension_exports_c_hooks():
    nm = subprocess.run(["nm", "-D", "--defined-only", _core._ucore.__file__],
                        capture_output=True, text=True)
    if nm.returncode != 0:
        pytest.skip("nm is not available")
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if " T " in line}
    assert {"ump_malloc", "ump_calloc", "ump_realloc", "ump_free"} <= exported
    assert not any(name.startswith("ump__") for name in exported)  # internals stay hidden


def test_without_cuda_bindings_the_probe_says_how_to_install_them(tmp_path):
    # None in sys.modules makes the import fail as it does where the package is absent
    code = ("import sys; sys.modules['cuda'] = None\n"
            "import ump\n"
            "caps = ump.probe()\n"
            "print(caps.gpu, ump.enable(), sep='\\n'); print(caps.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    gpu, backend, reason = out.stdout.splitlines()
    assert (gpu, backend) == ("False", "host")
    assert reason.startswith("cuda-bindings is not installed")
    assert "pip install ump-unified-memory[cuda12] or ump-unified-memory[cuda13]" in reason


def test_nested_enabled_keeps_the_outer_block_enabled(cpu_only):
    with ump.enabled(cap=64 << 20):
        with ump.enabled(cap=64 << 20):
            assert ump.is_enabled()
        assert ump.is_enabled() and ump.kind_of(np.ones(100)) == "host"  # the outer block still holds
    assert not ump.is_enabled()
    ump.enable()
    with ump.enabled():
        pass
    assert ump.is_enabled()  # enabled before the block: the block leaves it so


def test_options_as_an_instance_or_a_dict(cpu_only):
    opts = ump.Options(cap=64 << 20, placement="host")
    assert ump.enable(options=opts) == "host"
    assert ump.enable(options={"cap": 64 << 20, "placement": "host"}) == "host"  # the same request
    assert ump.statistics()["numpy"].cap_bytes == 64 << 20
    ump.disable()
    with pytest.raises(TypeError, match="not both"):
        ump.enable(options=opts, cap=1 << 30)
    with pytest.raises(TypeError, match="ump.Options or a dict"):
        ump.enable(options=[("cap", 1)])


def test_unknown_option_names_enable_and_the_options():
    with pytest.raises(TypeError, match=r"enable\(\) got unknown option\(s\) 'capp'; the options are cap, "):
        ump.enable(capp=1 << 30)


def test_cap_below_one_chunk_is_refused():
    with pytest.raises(ValueError, match=r"cap must be a number of bytes from 2097152 to 2\*\*63, got 4096 .one chunk"):
        ump.enable(cap=4096)
    with pytest.raises(ValueError, match="headroom must be a non-negative int"):
        ump.enable(headroom=-1)


def test_default_budgets_follow_where_memory_lives(monkeypatch):
    """The GPU budget is free device memory less the headroom for memory the
    GPU holds; host memory is bounded by a share of the host's as well."""
    from ump import backends

    monkeypatch.setattr(_probe, "host_available_bytes", lambda: 100 << 30)
    free, headroom = 140 << 30, 2 << 30
    assert backends.MANAGED.default_cap(free, headroom) == 138 << 30  # the host does not bound it
    assert backends.MANAGED.cupy_cap(free, headroom) == 138 << 30
    assert backends.PINNED.default_cap(free, headroom) == 75 << 30  # 3/4 of the host's
    assert backends.DEVICE.cupy_cap(free, headroom) == 138 << 30  # the VMM pool
    assert backends.DEVICE.default_cap(free, headroom) == 75 << 30  # its NumPy side is pinned
    assert backends.HOST.default_cap(None, 0) == 75 << 30
    assert backends.default_headroom(141 << 30) == (141 << 30) // 64
    assert backends.default_headroom(8 << 30) == 512 << 20
    assert backends.PINNED.spills_to_device and not backends.MANAGED.spills_to_device


def test_no_room_for_a_budget_is_a_clear_error(cpu_only, monkeypatch):
    monkeypatch.setattr(_probe, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(ump.UmpError, match="no room for the host backend's budget: the host has 1048576"):
        ump.enable()
    assert not ump.is_enabled()


def test_a_cap_beyond_free_device_memory_warns():
    """The budget check itself, with the device's numbers given: managed or
    pinned memory beyond what the GPU holds can hang a shared GPU."""
    from ump import _enable, backends

    free, total = 10 << 30, 16 << 30
    with pytest.warns(ump.UmpWarning, match="more than the device's free memory"):
        _enable._budgets(backends.MANAGED, ump.Options(cap=12 << 30), (free, total))
    assert _enable._budgets(backends.MANAGED, ump.Options(cap=8 << 30), (free, total))[:2] == (8 << 30, 8 << 30)
    # the device backend's pool is device memory: a large limit only fails allocations
    assert _enable._budgets(backends.DEVICE, ump.Options(cap=12 << 30), (free, total))[0] == 12 << 30


# --- enable() on a GPU machine, simulated: every failure is an UmpError ---

@pytest.fixture
def fake_gpu(monkeypatch):
    """enable() picks a GPU backend (pinned) on any machine; CuPy is an
    object, loading libcuda does nothing, and no arena or context is kept.
    The machine's probe is read first and stands in for enable()'s: the
    probe is cached for the process, and must not cache a fake driver's
    answers for the tests that follow. (A driver that answers for real is
    tests/test_driver.py's stub.)"""
    caps = _probe.probe()
    monkeypatch.setattr(_enable, "probe", lambda: caps)
    monkeypatch.setattr(backends, "select", lambda backend, caps, device=0: backends.PINNED)
    monkeypatch.setattr(_cupy_compat, "import_cupy", lambda: object())
    monkeypatch.setattr(_driver, "load", lambda: None)
    monkeypatch.setattr(_core, "cuda_set_context", lambda ctx, device: pytest.fail("no context to set"))
    monkeypatch.setattr(_devices, "_contexts", {})


def test_enable_needs_cupy_enable_ump_or_the_launchers_mark(fake_gpu, monkeypatch):
    """ump.enable() on a GPU needs CUPY_ENABLE_UMP=1, or UMP_LAUNCHED=1,
    which python -m ump run sets for its process tree. CuPy missing is an
    UmpError that says so."""
    monkeypatch.delenv("CUPY_ENABLE_UMP", raising=False)
    monkeypatch.delenv(_enable.LAUNCHED, raising=False)

    def no_cupy():
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(_cupy_compat, "import_cupy", no_cupy)
    with pytest.raises(ump.UmpError, match="CUPY_ENABLE_UMP=1 is not set"):
        ump.enable("pinned")
    monkeypatch.setenv(_enable.LAUNCHED, "1")
    with pytest.raises(ump.UmpError, match="pinned backend needs CuPy, which is not installed: pip install") as info:
        ump.enable("pinned")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert "CUPY_ENABLE_UMP" not in os.environ and not ump.is_enabled()


def test_a_cupy_that_fails_to_import_is_an_ump_error(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUPY_ENABLE_UMP", "1")

    def broken():
        raise OSError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(_cupy_compat, "import_cupy", broken)
    with pytest.raises(ump.UmpError, match="needs CuPy, which failed to import: OSError: libnvrtc"):
        ump.enable("pinned")
    assert not ump.is_enabled()


# --- threads ---

def _in_a_thread(fn):
    result = {}

    def call():
        try:
            result["value"] = fn()
        except BaseException as err:  # handed to the test
            result["error"] = err

    t = threading.Thread(target=call)
    t.start()
    t.join()
    return result


def test_disable_from_another_thread_is_refused_while_the_enabling_thread_runs(cpu_only):
    """NumPy's handler is per thread: only the thread that called enable()
    can put its own back. Another thread's disable() raises and changes
    nothing."""
    ump.enable()
    got = _in_a_thread(ump.disable)
    assert isinstance(got.get("error"), ump.UmpError), got
    assert "must be called from the thread that called ump.enable() (MainThread)" in str(got["error"])
    assert ump.is_enabled() and handler_name() == "ump" and ump.kind_of(np.ones(100)) == "host"
    assert ump.disable() is True
    assert handler_name() == "default_allocator" and ump.kind_of(np.ones(100)) is None


def test_any_thread_may_disable_once_the_enabling_thread_ended(cpu_only):
    got = _in_a_thread(ump.enable)
    assert got == {"value": "host"} and handler_name() == "default_allocator"  # this thread never had it
    assert ump.disable() is True and not ump.is_enabled()
    assert handler_name() == "default_allocator"


def test_any_thread_may_disable_when_a_thread_python_did_not_start_enabled(cpu_only):
    # Python knows such a thread only as a dummy that never ends.
    import _thread

    done = threading.Event()
    _thread.start_new_thread(lambda: (ump.enable(), done.set()), ())
    assert done.wait(10) and ump.is_enabled()
    assert ump.disable() is True and not ump.is_enabled()


def test_disable_restores_this_threads_handler_whatever_other_threads_did(cpu_only):
    """numpy_allocator's __enter__/__exit__ keep the handlers to restore on
    one list all threads share: a thread started under ump and still
    running at disable() must not hand the enabling thread its handler."""
    import numpy_allocator

    mine = numpy_allocator.type("mine", (), {})  # NumPy's functions, under another name
    release = threading.Event()
    seen = []
    with mine:
        ump.enable()
        t = threading.Thread(target=lambda: (seen.append(handler_name()), release.wait(10)))
        t.start()
        try:
            ump.disable()
            assert handler_name() == "mine"
        finally:
            release.set()
            t.join()
        assert seen == ["ump"]
    assert handler_name() == "default_allocator"


def _context_thread(target):
    """A thread that runs in a context of its own, empty, as Python 3.14
    runs threads (without -X thread_inherit_context)."""
    if sys.version_info >= (3, 14):
        return threading.Thread(target=target, context=contextvars.Context())

    class ContextThread(threading.Thread):  # 3.14's Thread, for earlier versions
        def start(self):
            self._context = contextvars.Context()
            super().start()

        def run(self):
            self._context.run(super().run)

    return ContextThread(target=target)


def test_threads_that_run_in_a_context_of_their_own_allocate_through_ump(cpu_only):
    ump.enable()
    seen = {}
    t = _context_thread(lambda: seen.update(name=handler_name(), kind=ump.kind_of(np.ones(100))))
    t.start()
    t.join()
    assert seen == {"name": "ump", "kind": "host"}
    assert t._context.run(handler_name) == "default_allocator"  # put back when the thread ended
