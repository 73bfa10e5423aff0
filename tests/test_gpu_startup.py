"""What works with stock CuPy keeps working under ump: the whole GPU, any
import order, recovery from out-of-memory, stock conversions, every device.

Run with CUPY_ENABLE_UMP=1 on a CUDA machine; skipped elsewhere.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import ump
from _gpu import require_backend

pytestmark = pytest.mark.gpu

GiB = 1 << 30


def _python(code, *args, env=None, timeout=600):
    environ = {**os.environ, **(env or {})}
    environ = {k: v for k, v in environ.items() if v is not None}  # None: unset
    # in a directory of its own: no source tree there shadows the installed ump
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                         text=True, env=environ, timeout=timeout, cwd=tempfile.gettempdir())
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


ROUND_TRIP = """
    a = np.arange(1 << 20, dtype=np.float32)
    g = cupy.asarray(a)
    g *= 2
    b = cupy.asnumpy(g)
    shared = g.data.ptr == a.ctypes.data == b.ctypes.data
    assert b[3] == 6.0 and a[3] == 6.0 and shared, (b[3], a[3], shared)
    assert cupy.array([1, 2, 3]).tolist() == [1, 2, 3]      # CuPy's own list path
    x = cupy.arange(12).reshape(3, 4)
    assert x[[0, 2]].shape == (2, 4) and cupy.concatenate([x, x]).shape == (6, 4)
"""


def test_enable_imports_no_cuda_bindings(gpu_caps):
    """ump.enable() reads the GPU, retains its context and asks for its free
    memory through the C core: cuda-bindings' driver module (tens of
    milliseconds of a program's start-up) is not imported for it. CuPy may
    import it itself, so what counts is what enabling adds."""
    out = _python("""
        import sys
        import cupy
        before = "cuda.bindings.driver" in sys.modules
        import ump
        ump.enable()
        print(before, "cuda.bindings.driver" in sys.modules)
    """, env={"CUPY_ENABLE_UMP": "1"})
    before, after = out.split()
    assert after == before, "ump.enable() imported cuda.bindings.driver"


@pytest.mark.parametrize("cupy_env", ["1", None], ids=["cupy-imported-with-UMP", "cupy-imported-plain"])
def test_enable_after_cupy_was_imported(gpu_caps, cupy_env):
    code = ("import os, numpy as np\n"
            "import cupy\n"  # first, as real programs and CuPy's test runner do
            "os.environ['CUPY_ENABLE_UMP'] = '1'\n"
            "import ump\n"
            "print(ump.enable())\n"
            "from ump._cupy_compat import builtin_ump_active\n"
            "assert not builtin_ump_active(cupy)  # CuPy's own path is off, as if imported after\n"
            + textwrap.dedent(ROUND_TRIP))
    env = {k: v for k, v in os.environ.items() if k != "CUPY_ENABLE_UMP"}
    if cupy_env:
        env["CUPY_ENABLE_UMP"] = cupy_env
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tempfile.gettempdir())
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[0] in ("managed", "pinned", "system")


CHILD = """
    import os, subprocess
    child = "import os, cupy; print(os.environ.get('CUPY_ENABLE_UMP'), cupy.array([1, 2, 3]).tolist())"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    print(os.environ.get("CUPY_ENABLE_UMP"), out.strip())
    enables = ("import numpy as np, ump; print(ump.enable('pinned', cap=1 << 30)); import cupy; "
               "a = np.ones(4); print(cupy.asarray(a).data.ptr == a.ctypes.data)")
    out = subprocess.run([sys.executable, "-c", enables], capture_output=True, text=True, check=True).stdout
    print(*out.split())
"""


def test_launcher_runs_a_script_zero_copy(gpu_caps, tmp_path):
    """Without CUPY_ENABLE_UMP=1, which the launcher neither needs nor sets:
    a child process of the program, without ump, runs stock CuPy, whose own
    UMP path (it asserts on GPUs without HMM/ATS) stays off; a child that
    enables ump (a Dask worker with ump's plugin) needs no variable either."""
    script = tmp_path / "prog.py"
    script.write_text("import sys, numpy as np, cupy, ump\n" + textwrap.dedent(ROUND_TRIP)
                      + textwrap.dedent(CHILD) + "print(ump.backend(), sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != "CUPY_ENABLE_UMP"}
    run = subprocess.run([sys.executable, "-m", "ump", "run", "--backend", "pinned", "--cap", "2G",
                          str(script), "x", "--y"], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines() == ["None None [1, 2, 3]", "pinned True", "pinned ['x', '--y']"]


def test_pytest_plugin_runs_a_suite_under_ump(gpu_caps, tmp_path):
    (tmp_path / "test_prog.py").write_text(
        "import numpy as np, cupy, ump\n\ndef test_shared():\n"
        + textwrap.indent(textwrap.dedent(ROUND_TRIP), "    ")
        + "    assert ump.backend() == 'managed'\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ump.pytest_plugin", "--ump=managed",
                          "--ump-cap=2G", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout


FILL = """
    import sys, numpy as np
    backend = sys.argv[1]
    if backend != "stock":
        import ump
        ump.enable(backend)
    import cupy
    held = []
    try:
        while True:
            held.append(cupy.empty(1 << 30, dtype=cupy.uint8))
    except cupy.cuda.memory.OutOfMemoryError:
        pass
    # A NumPy -> CuPy -> NumPy round trip while CuPy holds all that but one
    # GiB, in every configuration alike: what is left under a budget (or
    # the GPU) once the last 1 GiB array failed can be less than the round
    # trip's two 4 MiB arrays, in stock CuPy as under ump.
    del held[-1:]
    b = cupy.asnumpy(cupy.asarray(np.arange(1 << 20, dtype=np.float32)) * 2)
    assert b[3] == 6.0
    print(len(held))
"""


@pytest.mark.serial
def test_cupy_gets_the_whole_gpu(gpu_caps, record_property):
    """Default options: CuPy allocates >= 95 % of what stock CuPy allocates
    in the same process layout, and NumPy <-> CuPy still works while it
    holds all that but one GiB."""
    stock_env = {"CUPY_ENABLE_UMP": None}
    stock = int(_python(FILL, "stock", env=stock_env).split()[-1])
    results = {"stock": stock}
    for name in ("managed", "pinned", "device"):
        from ump import backends

        if backends.get(name).unavailable(gpu_caps, gpu_caps.devices[0]) is not None:
            continue
        results[name] = int(_python(FILL, name).split()[-1])
    record_property("gib_allocated", results)
    print(f"\nGiB CuPy allocated: {results}")
    for name, got in results.items():
        assert got >= 0.95 * stock, f"{name}: {got} GiB against stock's {stock} GiB"


@pytest.mark.parametrize("name", ["managed", "device"])
def test_out_of_memory_recovers_by_collecting(gpu_caps, name):
    """Arrays that only a reference cycle keeps alive are collected before
    CuPy's allocation fails, as CuPy's own pool does; the final error is the
    one stock CuPy users catch."""
    require_backend(gpu_caps, name)
    ump.enable(name, cap=8 * GiB)
    import cupy

    class Node:
        pass

    gc.disable()
    try:
        node = Node()
        node.me, node.data = node, cupy.ones(5 * GiB, dtype=cupy.uint8)
        del node  # garbage, but only the collector can free it
        again = cupy.ones(5 * GiB, dtype=cupy.uint8)
        assert int(again[-1]) == 1
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
            cupy.empty(16 * GiB, dtype=cupy.uint8)
        assert isinstance(info.value, ump.OutOfMemoryError)
        del again
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.uint16])
def test_casts_follow_numpy_as_in_stock_cupy(gpu_backend, dtype):
    """Stock CuPy casts a NumPy array with NumPy on the host; out-of-range
    float to int casts differ on the GPU, so ump casts on the host too."""
    _, cupy = gpu_backend
    a = np.array([1e10, -1.5, 300.7, -129.0, 70000.2, 2.5], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        expected = a.astype(dtype)
        got = cupy.array(a, dtype=dtype)
        got2 = cupy.asarray(a, dtype=dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(cupy.asnumpy(got), expected)
    np.testing.assert_array_equal(cupy.asnumpy(got2), expected)
    assert a[0] == 1e10  # the source is untouched


@pytest.mark.parametrize("name", ["managed", "pinned", "device"])
def test_arrays_belong_to_the_current_device(gpu_caps, name):
    require_backend(gpu_caps, name)
    ump.enable(name, cap=4 * GiB)
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    a = np.arange(1 << 16, dtype=np.float64)
    with cupy.cuda.Device(1):
        g = cupy.arange(1 << 16, dtype=cupy.float64)
        h = cupy.asarray(a)
        assert g.device.id == 1 and h.device.id == 1
        assert float((g + h).sum()) == float(2 * a.sum())
        if name != "device":
            assert h.data.ptr == a.ctypes.data
        back = cupy.asnumpy(g)
    assert back[-1] == (1 << 16) - 1
    # The driver names the device each array belongs to (PyTorch reads it):
    # the chunks of each device's arena or pool are made under its context.
    g0 = cupy.arange(1 << 16, dtype=cupy.float64)
    attributes = cupy.cuda.runtime.pointerGetAttributes
    assert attributes(g.data.ptr).device == 1 and attributes(g0.data.ptr).device == 0
