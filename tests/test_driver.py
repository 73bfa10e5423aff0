"""The driver as ump's Python layer reaches it through the C core
(csrc/device.c, ump/_driver.py): the probe, primary contexts, free memory and
peer access, run on the CPU against the stub driver (tests/c/stub_cuda.c) in
fresh processes, and without any driver. No cuda-bindings is imported on
these paths: enabling ump must not pay for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from _stub import result, run
from ump import _core

GiB = 1 << 30


def test_without_a_driver_every_c_call_says_so(tmp_path):
    """Before libcuda.so.1 is opened (or where there is none) the probe's and
    the contexts' C calls return UMP_ERR_NOCUDA, which the one status table
    turns into an UmpError naming it: nothing crashes, nothing is retained."""
    code = """
import ctypes, json
from ump import _core, _driver
from ump._errors import UmpError
statuses = {
    "init": _core.cuda_init(ctypes.byref(ctypes.c_int()), ctypes.byref(ctypes.c_int())),
    "probe": _core.device_probe(0, ctypes.byref(_core._CDevice()), None, 0),
    "retain": _core.device_retain(0, ctypes.byref(_core._uptr())),
    "memory": _core.device_memory(0x1000, ctypes.byref(_core._u64()), ctypes.byref(_core._u64())),
    "peer": _core.device_can_access_peer(0, 1, ctypes.byref(ctypes.c_int())),
    "active": _core.device_active(0, ctypes.byref(ctypes.c_int())),
    "push": _core.context_push(0x1000),
}
try:
    _driver.device_count()
except UmpError as err:
    error = [type(err).__name__, err.cuda_error, str(err)]
print(json.dumps([statuses, _core.ERR_NOCUDA, error, "cuda.bindings" in sys.modules]))
"""
    proc = subprocess.run([sys.executable, "-c", "import sys\n" + code], capture_output=True, text=True,
                          cwd=tmp_path)
    statuses, nocuda, error, bindings = result(proc)
    assert set(statuses.values()) == {nocuda}, statuses
    assert error == ["UmpError", "UMP_ERR_NOCUDA", "cuInit failed: libcuda.so.1 is not loaded (UMP_ERR_NOCUDA)"]
    assert not bindings


def test_a_missing_driver_library_is_no_driver(tmp_path):
    code = """
import json
from ump import _core
print(json.dumps(_core._cuda_load(b"/nonexistent/libcuda.so.1") == _core.ERR_NOCUDA))
"""
    assert result(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path))


def test_the_probe_reads_every_device_through_the_c_core(stub_cuda, tmp_path):
    """The stub has two devices (H100-like, no HMM/ATS); what the probe
    reports is what the driver answered, field by field, with no CUDA
    context made and no cuda-bindings imported."""
    proc = run(stub_cuda, """
from ump import _probe
_probe._bindings_missing = lambda: None  # no cuda-bindings here: the probe itself needs none
caps = _probe.probe()
print(json.dumps([caps.gpu, caps.reason, caps.driver_version, [vars(d) for d in caps.devices],
                  retained(0), "cuda.bindings" in sys.modules]))
""", tmp_path, STUB_CUDA_DEVICES="2")
    gpu, reason, version, devices, contexts, bindings = result(proc)
    assert (gpu, reason, version, contexts, bindings) == (True, None, 13000, 0, False)
    assert [d["name"] for d in devices] == ["ump stub GPU 0", "ump stub GPU 1"]
    assert devices[1] == {
        "index": 1, "name": "ump stub GPU 1", "compute_capability": [9, 0], "total_memory": 16 * GiB,
        "managed_memory": True, "pageable_memory_access": False, "uses_host_page_tables": False,
        "concurrent_managed_access": True, "host_pointer_for_registered_mem": True, "vmm_supported": True,
        "vmm_granularity": 2 << 20, "vmm_recommended_granularity": 2 << 20}


def test_a_context_is_retained_once_and_reports_its_free_memory(stub_cuda, tmp_path):
    proc = run(stub_cuda, """
from ump import _devices, _driver
first = _devices.context(1)
again = _devices.context(1)
print(json.dumps([first, again, retained(1), retained(0), _driver.active_devices(2),
                  _driver.can_access_peer(0, 1), _driver.can_access_peer(1, 1), _driver.exports_fds(0)]))
""", tmp_path, STUB_CUDA_DEVICES="2")
    first, again, held, other, active, peer, itself, fds = result(proc)
    assert first == again == [0x1001, 12 * GiB, 16 * GiB]
    assert (held, other, active) == (1, 0, [1])  # retained once, for the process
    assert (peer, itself, fds) == (True, False, True)


def test_a_context_made_current_for_cuda_bindings_is_given_back(stub_cuda, tmp_path):
    """_driver.current() pushes the device's context for calls made through
    cuda-bindings (inter-process events) and lets go of it after, also when
    the block raises."""
    proc = run(stub_cuda, """
from ump import _driver
with _driver.current(0) as ctx:
    inside = retained(0)
try:
    with _driver.current(0):
        raise KeyError("the block failed")
except KeyError:
    pass
print(json.dumps([ctx, inside, retained(0)]))
""", tmp_path)
    assert result(proc) == [0x1000, 1, 0]


#: enable() on the stub: the GPU backend is chosen and CuPy stands in as an
#: object, so only the driver's part of enabling runs for real.
ENABLE_ON_THE_STUB = """
import ump
from ump import _cupy_compat, _devices, backends
backends.select = lambda backend, caps, device=0: backends.PINNED
_cupy_compat.import_cupy = lambda: object()
os.environ["CUPY_ENABLE_UMP"] = "1"
"""


def test_a_gpu_without_room_for_a_context_is_an_ump_error(stub_cuda, tmp_path):
    """The driver's error reaches the user as an UmpError naming it, with
    why, and nothing stays enabled or retained."""
    proc = run(stub_cuda, ENABLE_ON_THE_STUB + """
try:
    ump.enable("pinned")
except ump.UmpError as err:
    caught = [err.message, err.cuda_error, str(err), type(err.__cause__).__name__]
print(json.dumps([caught, ump.is_enabled(), _devices._contexts, retained(0), "cuda.bindings" in sys.modules]))
""", tmp_path, STUB_CUDA_FULL="1")
    (message, cuda_error, text, cause), enabled, contexts, held, bindings = result(proc)
    assert message.startswith("setting up the CUDA context of device 0: the GPU has no room")
    assert "cuDevicePrimaryCtxRetain failed" in message
    assert cuda_error == "CUDA_ERROR_OUT_OF_MEMORY" and text.endswith("(CUDA_ERROR_OUT_OF_MEMORY)")
    assert cause == "OutOfMemoryError"  # the C status, mapped by the one table
    assert (enabled, contexts, held) == (False, {}, 0)
    assert not bindings  # the probe, the driver's loading and the context: no cuda-bindings


def test_the_launcher_reports_a_failing_driver_in_one_line(stub_cuda, tmp_path):
    script = tmp_path / "x.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    proc = run(stub_cuda, ENABLE_ON_THE_STUB + f"""
from ump._options import TABLE
for var in ("CUPY_ENABLE_UMP", *(option.env for option in TABLE.values())):
    os.environ.pop(var, None)
from ump.__main__ import main
main(["run", {str(script)!r}])
""", tmp_path, STUB_CUDA_FULL="1")
    assert proc.returncode == 2, proc.stderr
    usage, line = proc.stderr.splitlines()
    assert usage.startswith("usage: python -m ump run")
    assert line.startswith("python -m ump run: error: setting up the CUDA context of device 0")
    assert proc.stderr.rstrip().endswith("(CUDA_ERROR_OUT_OF_MEMORY)") and "Traceback" not in proc.stderr


def test_a_pool_that_fails_to_open_releases_the_primary_context(stub_cuda, tmp_path):
    """VMMPool retains its device's primary context; a bad limit or a full
    pool table must not leave it retained."""
    proc = run(stub_cuda, """
import ump
from ump import _probe
_probe._bindings_missing = lambda: None
out = []
for limit in (1.5, -1):
    try:
        ump.VMMPool(0, limit=limit)
    except ValueError as err:
        out.append(str(err))
_core.vmm_create = lambda *args: _core.ERR_ARG  # the C side refuses: a 17th pool
try:
    ump.VMMPool(0)
except ump.UmpError as err:
    out.append(str(err))
print(json.dumps([out, retained(0)]))
""", tmp_path)
    errors, held = result(proc)
    assert "fraction" in errors[0] and "limit" in errors[1]
    assert f"at most {_core.MAX_POOLS} pools" in errors[2]
    assert held == 0


@pytest.mark.parametrize("devices", [0, 1])
def test_the_probe_says_why_a_driver_is_of_no_use(stub_cuda, tmp_path, devices):
    proc = run(stub_cuda, """
from ump import _probe
_probe._bindings_missing = lambda: None
caps = _probe.probe()
print(json.dumps([caps.gpu, caps.reason, len(caps.devices)]))
""", tmp_path, STUB_CUDA_DEVICES=str(devices))
    gpu, reason, n = result(proc)
    assert (gpu, n) == (bool(devices), devices)
    assert reason == (None if devices else "the CUDA driver reports no device")


def test_the_probe_without_a_driver_library_says_so(tmp_path):
    """Where libcuda.so.1 cannot be opened (here: a path with none), the
    probe reports no GPU, with why, and raises nothing."""
    code = """
import json
from ump import _core, _driver, _probe
_probe._bindings_missing = lambda: None
_driver.load = lambda: _core.check(_core._cuda_load(b"/nonexistent/libcuda.so.1"), "loading libcuda")
caps = _probe.probe()
print(json.dumps([caps.gpu, caps.reason, caps.devices, caps.driver_version]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result(proc) == [False, "no CUDA driver: libcuda.so.1 could not be opened", [], None]
