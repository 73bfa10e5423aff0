"""Every reader sees finished data: each path by which the host or another
library reaches a CuPy array, on every backend, raced against a kernel.

Run with CUPY_ENABLE_UMP=1 on a CUDA machine; skipped elsewhere. The table
in docs/interop.md is generated from INTEROP below (tools/interop_table.py),
so the documented behaviour is what these tests check.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

import ump
from ump import _core

#: Every backend with a GPU side, the device backend included.
pytestmark = [pytest.mark.gpu,
              pytest.mark.parametrize("gpu_backend", ["managed", "pinned", "device", "system"], indirect=True)]

# A kernel that spins ~50 ms before it writes: a read that does not wait
# for it sees the old values.
SPIN = r"""
extern "C" __global__ void spin_then_write(double *x, long n, long long cycles, double value) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    long long start = clock64();
    while (clock64() - start < cycles) {}
    if (i < n) x[i] = value;
}
"""
CYCLES = 100_000_000  # ~50 ms at the H200's 1.98 GHz
ROUNDS = 20
N = 1 << 14


def _spin_kernel(cupy):
    return cupy.RawKernel(SPIN, "spin_then_write")


def _host_readers(cupy):
    """name -> (read(g) -> NumPy values, shares(gpu_backend) -> whether the
    result is at g's address). What docs/interop.md lists."""

    def from_interface(g):
        class Holder:
            __array_interface__ = g.__array_interface__

        return np.asarray(Holder())

    def buffer(g):
        return np.frombuffer(memoryview(g), dtype=g.dtype)

    unified = ("managed", "pinned", "system")
    return {
        # the arrays here (128 KiB) are small results CuPy made, which
        # get() copies out of managed memory (test_small_results_... below)
        "cupy.asnumpy": (cupy.asnumpy, ("pinned", "system")),
        "ndarray.get": (lambda g: g.get(), ("pinned", "system")),
        "numpy.asarray": (np.asarray, unified),
        "numpy.array": (lambda g: np.array(g), ()),
        "numpy.from_dlpack": (np.from_dlpack, unified),
        "__array_interface__": (from_interface, unified),
        "__array__": (lambda g: g.__array__(), unified),
        "memoryview": (buffer, unified),
        "pickle": (lambda g: cupy.asnumpy(pickle.loads(pickle.dumps(g))), ()),
        "tolist": (lambda g: np.array(g.tolist()), ()),
        "item": (lambda g: np.array([g[-1:].item()]), ()),
        "repr": (lambda g: np.array([float(repr(g[-1:]).split("[")[1].split("]")[0])]), ()),
    }


PATHS = [
    "cupy.asnumpy", "ndarray.get", "numpy.asarray", "numpy.array", "numpy.from_dlpack",
    "__array_interface__", "__array__", "memoryview", "pickle", "tolist", "item", "repr"]


@pytest.fixture(scope="session")
def record():
    """Append what a path did on a backend to $UMP_INTEROP_RECORD (JSON
    lines), from which tools/interop_table.py writes docs/interop.md."""
    path = os.environ.get("UMP_INTEROP_RECORD")

    def write(**row):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return write


def _race(cupy, g, stream, value):
    """Queue a ~50 ms kernel on `stream` that writes `value` into g."""
    with stream:
        _spin_kernel(cupy)(((g.size + 255) // 256,), (256,), (g, np.int64(g.size), np.int64(CYCLES),
                                                               np.float64(value)))


REFUSALS = {  # (path, backend) -> the error, for memory the host cannot read in place
    ("memoryview", "device"): (BufferError, lambda g: memoryview(g)),
    ("__array_interface__", "device"): (AttributeError, lambda g: g.__array_interface__),
    # NumPy asks for no copy and no device, and refuses kDLCUDA, as with stock CuPy
    ("numpy.from_dlpack", "device"): ((BufferError, RuntimeError), np.from_dlpack),
}


@pytest.mark.parametrize("path", PATHS)
def test_host_reader_waits_for_the_kernel(gpu_backend, path, record):
    name, cupy = gpu_backend
    if path == "memoryview" and sys.version_info < (3, 12):
        pytest.skip("memoryview of a CuPy array needs Python >= 3.12 (__buffer__)")
    if (path, name) in REFUSALS:
        error, call = REFUSALS[path, name]
        with pytest.raises(error):
            call(cupy.zeros(8))
        record(path=path, backend=name, result="refuses")
        return
    read, shares = _host_readers(cupy)[path]
    stream = cupy.cuda.Stream(non_blocking=True)
    g = cupy.zeros(N, dtype=cupy.float64)
    same = set()
    for i in range(1, ROUNDS + 1):
        _race(cupy, g, stream, float(i))
        out = read(g)  # at once: the kernel is still spinning
        assert out[-1] == i and (out == i).all(), f"round {i}: read before the kernel finished"
        same.add(out.__array_interface__["data"][0] == g.data.ptr)
    assert same == {name in shares}
    record(path=path, backend=name, result="shares" if name in shares else "copies", waits=ROUNDS)


def test_small_results_cupy_made_in_managed_memory_are_copied_by_get(gpu_backend):
    """``get()`` and ``cupy.asnumpy`` copy an array that CuPy made in
    managed memory spanning less than ``prefetch_min`` (2 MiB), a small
    result or a small piece of a larger one: its pages are on the GPU, and
    a read in place faults them over to the host and the next kernel there
    faults them back (PyLops's solvers read such arrays each step). Larger
    results and NumPy's memory handed to CuPy are shared, as is every array
    on the other unified backends, and ``ump.asnumpy`` and
    ``numpy.asarray`` share them all; ``device`` copies everything."""
    name, cupy = gpu_backend
    small = cupy.arange(1 << 10, dtype=cupy.float64)  # 8 KiB
    large = cupy.arange(1 << 19, dtype=cupy.float64)  # 4 MiB
    handed = cupy.asarray(np.arange(1 << 10, dtype=np.float64))
    cupy.cuda.runtime.deviceSynchronize()  # a non-blocking stream does not wait for arange
    with cupy.cuda.Stream(non_blocking=True):
        for g in (small, large, handed):
            g *= 2
    piece = large[:1 << 10]  # 8 KiB of a larger result
    unified = name != "device"
    for read in (cupy.asnumpy, lambda g: g.get()):
        for g in (small, large, handed, piece):
            h = read(g)
            assert (h == 2 * np.arange(g.size)).all()
            shared = h.ctypes.data == g.data.ptr
            assert shared == (unified and (name != "managed" or g is large or g is handed)), (name, g.nbytes)
    assert (ump.asnumpy(small).ctypes.data == small.data.ptr) == unified
    assert (np.asarray(small).ctypes.data == small.data.ptr) == unified
    copy = small.get()
    copy[0] = -1.0  # where get() copied, CuPy's array keeps its value
    assert float(small[0]) == (-1.0 if name in ("pinned", "system") else 0.0)


def test_a_scalar_is_the_value_the_kernel_wrote_and_managed_memory_copies_it(gpu_backend, monkeypatch):
    """bool(), int(), float(), complex() and item() of a one-element array
    return what a kernel still running on another stream writes (the wait).
    On managed memory the element is copied, not read in place: no export,
    so the host never faults in the page that a solver's next kernel writes
    (``if norm(r) < tol`` each step). CuPy's errors for other sizes stay."""
    name, cupy = gpu_backend
    hook = ump._enable.current().cupy
    exports = []
    export = hook.export
    monkeypatch.setattr(hook, "export", lambda g, *a, **k: exports.append(g.size) or export(g, *a, **k))
    stream = cupy.cuda.Stream(non_blocking=True)
    g = cupy.zeros(N, dtype=cupy.float64)
    conversions = (bool, int, float, complex, lambda x: x.item())
    for i, convert in enumerate(conversions * 4, 1):
        _race(cupy, g, stream, float(i))
        got = convert(g[-1])  # at once: the kernel is still spinning
        assert got == convert(np.float64(i)) and type(got) is type(convert(np.float64(i))), f"round {i}"
    assert (exports == []) == (name == "managed"), exports
    last = float(len(conversions) * 4)
    for convert in conversions:  # a one-element 1-d array converts, or is refused, as NumPy's
        try:
            expected = convert(np.full(1, last))
        except TypeError:
            with pytest.raises(TypeError):
                convert(g[:1])
        else:
            assert convert(g[:1]) == expected
    flags = cupy.array([True, False])
    assert bool(flags[0]) is True and flags[1].item() is False
    fields = ",".join(["f8"] * 9)  # 72 bytes: wider than the pinned buffer an element is copied into
    wide = cupy.asarray(np.array([tuple(range(9))], dtype=fields))
    assert wide[0].item() == tuple(float(i) for i in range(9))
    assert complex(cupy.full((), 1 + 2j)) == 1 + 2j and int(cupy.arange(5, dtype=cupy.int8)[3]) == 3
    with pytest.raises(ValueError, match="ambiguous"):
        bool(flags)
    with pytest.raises(ValueError, match="size 1"):
        flags.item()
    with pytest.warns(DeprecationWarning):
        assert bool(cupy.zeros(0)) is False


def test_a_scalar_read_keeps_nothing_of_its_pinned_buffer_and_gives_it_back(gpu_backend):
    """Managed memory's element is copied into a pinned buffer that the next
    read reuses: a structured element's subarray field read first keeps its
    values after a second read, and a conversion that raises still gives
    the buffer back (no buffer is lost or made per read)."""
    name, cupy = gpu_backend
    if name != "managed":
        pytest.skip(f"backend {name} reads elements through CuPy's own copy, not ump's pinned buffers")
    hook = ump._enable.current().cupy
    fields = np.dtype([("a", "f8", (2,)), ("b", "i8")])  # 24 bytes: within the pinned buffer
    host = np.zeros(2, dtype=fields)
    host[0], host[1] = ((1.0, 2.0), 3), ((4.0, 5.0), 6)
    g = cupy.asarray(host.view(np.float64))
    records = cupy.ndarray((2,), fields, g.data)
    first = records[0].item()
    second = records[1].item()
    assert first[0].tolist() == [1.0, 2.0] and first[1] == 3, first
    assert second[0].tolist() == [4.0, 5.0] and second[1] == 6, second
    buffers = list(hook._element_buffers)
    for i in range(4):
        records[i % 2].item()
    assert len(buffers) == 1 and hook._element_buffers == buffers, "a read made or kept a buffer of its own"

    def refuse(value):
        raise LookupError(f"refused {value!r}")

    with pytest.raises(LookupError, match="refused"):
        hook.scalar(g[1], refuse)
    assert hook._element_buffers == buffers
    assert float(g[1]) == 2.0 and hook._element_buffers == buffers


def test_a_scalar_read_queues_its_copy_behind_every_blocking_streams_kernel(gpu_backend, monkeypatch):
    """While every stream is one the legacy default stream follows (the
    default ones, blocking streams), a scalar of managed memory is copied
    on the legacy stream before the wait: one round trip, as stock CuPy's
    copy on its stream. It still reads what a kernel queued on another
    blocking stream wrote, and the read from the default stream too."""
    name, cupy = gpu_backend
    hook = ump._enable.current().cupy
    monkeypatch.setattr(hook.side_streams, "seen", False)  # the streams of earlier tests are gone
    monkeypatch.setattr(hook.side_streams, "exported_blocks", set())  # and their exports
    runtime = cupy.cuda.runtime
    queued = []
    copy_async = runtime.memcpyAsync
    monkeypatch.setattr(runtime, "memcpyAsync", lambda *a: queued.append(a[-1]) or copy_async(*a))
    g = cupy.zeros(N, dtype=cupy.float64)
    streams = [cupy.cuda.Stream(), cupy.cuda.Stream.null]  # a blocking stream, and the default one
    for i in range(1, 9):
        _race(cupy, g, streams[i % 2], float(i))
        assert float(g[-1]) == i, f"round {i}: read before the kernel finished"
    wide = cupy.ndarray((1,), ",".join(["f8"] * 9), g.data)  # g's first 72 bytes: copied into pageable memory
    for value in (9.0, 10.0, 11.0):
        _race(cupy, g, streams[0], value)
        assert wide[0].item() == (value,) * 9, f"{value}: a wide element read before the kernel finished"
    assert hook.side_streams.unordered_work_possible() is False
    capture = cupy.cuda.Stream()
    with capture:
        capture.begin_capture()
        try:
            with pytest.raises(ump.UmpError, match="capturing"):
                float(g[-1])
        finally:
            capture.end_capture()  # still valid: nothing was queued while it captured
    if name == "managed" and hook.release.one_gpu():  # several GPUs: the wait comes first
        assert queued == [hook.side_streams.legacy] * 11  # each copy queued before its wait


def test_a_scalar_read_waits_first_once_a_stream_the_legacy_one_does_not_follow_may_have_work(
        gpu_backend, monkeypatch):
    """A non-blocking stream made before ``enable()`` (found when the first
    scalar is read), one wrapped from another library's handle
    (``Stream.from_external``), and an export to another GPU library each
    make the scalar read wait for the device before it copies: a copy on
    the legacy stream would overtake their kernels."""
    name, cupy = gpu_backend
    runtime = cupy.cuda.runtime
    sides = ump._enable.current().cupy.side_streams
    monkeypatch.setattr(sides, "seen", False)
    monkeypatch.setattr(sides, "exported_blocks", set())
    ump.disable()
    early = cupy.cuda.Stream(non_blocking=True)
    ump.enable(name, cap=4 << 30)
    handle = runtime.streamCreateWithFlags(runtime.streamNonBlocking)

    class Foreign:  # another library's stream, as PyTorch's is
        def __cuda_stream__(self):
            return (0, handle)

    g = cupy.zeros(N, dtype=cupy.float64)

    def reads_wait_for(stream, first):
        for value in range(first, first + 4):
            _race(cupy, g, stream, float(value))
            assert float(g[-1]) == value, f"{value}: read before the kernel finished"
        assert sides.unordered_work_possible() is True

    try:
        reads_wait_for(early, 10)
        sides.seen = False
        reads_wait_for(cupy.cuda.Stream.from_external(Foreign()), 20)
        sides.seen = False
        assert g.__cuda_array_interface__["data"][0] == g.data.ptr
        assert sides.unordered_work_possible() is True  # a consumer's own streams are unseen
    finally:
        runtime.deviceSynchronize()
        runtime.streamDestroy(handle)


def test_a_block_handed_to_another_library_is_waited_for_first_and_no_other(gpu_backend, monkeypatch):
    """Once an array was handed to another GPU library, reads of its block
    wait for the device before they copy: the library may write it on a
    stream of its own (here a real non-blocking stream ump was not told
    of, standing for PyTorch's). Reads of every other block of an arena
    stay one round trip, as with stock CuPy: a scalar's copy queued on the
    legacy stream before the wait, and ``get()``'s small copy (CuPy's own,
    on its null stream, behind a blocking stream's kernel) with no wait
    before it; under ``device`` (VMM pool memory, which aliases map twice)
    every read waits first. Each read sees the value the last kernel
    wrote."""
    name, cupy = gpu_backend
    per_block = name != "device"
    hook = ump._enable.current().cupy
    sides, runtime = hook.side_streams, cupy.cuda.runtime
    monkeypatch.setattr(sides, "seen", False)  # the streams of earlier tests are gone
    monkeypatch.setattr(sides, "exported_blocks", set())
    with monkeypatch.context() as m:
        m.setattr(sides, "note", lambda stream: None)
        unseen = cupy.cuda.Stream(non_blocking=True)
    blocking = cupy.cuda.Stream()
    hook.pool.free_all_blocks()  # no cached block for CuPy's pool to split for both arrays
    handed, kept = cupy.zeros(N, dtype=cupy.float64), cupy.zeros(N, dtype=cupy.float64)
    assert handed.__cuda_array_interface__["data"][0] == handed.data.ptr  # Numba, say, takes it
    handed_block, kept_block = (_core.lookup_ids(a.data.ptr)[1] for a in (handed, kept))
    if handed_block == kept_block:
        pytest.skip("CuPy's pool put both arrays in one block of ump's")
    assert sides.unordered_work_possible(handed_block) is True
    assert sides.unordered_work_possible(kept_block) is not per_block
    waits, queued, out = [], [], np.empty(4)
    wait_for, copy_async = hook.release.wait_for, runtime.memcpyAsync
    monkeypatch.setattr(hook.release, "wait_for", lambda *a: waits.append("wait") or wait_for(*a))
    monkeypatch.setattr(runtime, "memcpyAsync", lambda *a: queued.append(a[-1]) or copy_async(*a))
    for value in (1.0, 2.0):
        _race(cupy, handed, unseen, value)
        assert float(handed[-1]) == value, f"{value}: read before the other library's kernel finished"
        _race(cupy, handed, unseen, value + 10)
        assert cupy.asnumpy(handed[-4:])[-1] == value + 10, f"{value}: a copy overtook the kernel"
        _race(cupy, kept, blocking, value + 20)
        assert cupy.asnumpy(kept[-4:])[-1] == value + 20, f"{value}: a copy overtook the kernel"
        _race(cupy, kept, blocking, value + 30)
        kept[-4:].get(out=out)
        assert out[-1] == value + 30, f"{value}: a copy into out overtook the kernel"
        _race(cupy, kept, blocking, value + 40)
        assert kept[::2].get()[-1] == value + 40, f"{value}: a strided copy overtook the kernel"
    if not hook.release.one_gpu():
        return  # several GPUs: every read waits for them first
    waits.clear()
    kept[-4:].get(out=out)
    assert waits == ([] if per_block else ["wait"]), "get() of a block nobody else took: the wait first"
    waits.clear()
    handed[-4:].get(out=out)
    assert waits == ["wait"], "get() of the handed block did not wait for the device first"
    if name == "managed":  # scalars are read by ump in managed memory only
        queued.clear()
        float(kept[-1])
        assert queued == [sides.legacy], "a scalar of another block did not queue its copy before the wait"
        queued.clear()
        float(handed[-1])
        assert queued == [], "a scalar of the handed block queued its copy before the wait"


def test_an_enable_that_imports_cupy_looks_for_no_stream_made_before_it(gpu_backend, tmp_path):
    """When ``enable()`` imports CuPy itself (``python -m ump run``), no
    work can have been queued through it unwatched: the first scalar read
    queues its copy before the wait, with no scan of the collector's
    objects. CuPy imported first, with a non-blocking stream made before
    ``enable()``: the first read waits for the device, and the scan finds
    that stream. Each read sees the value a kernel that spins first wrote,
    on the default stream, then on a blocking and a non-blocking stream made
    after ``enable()`` (noted as they are made: the reads then wait first)."""
    code = f"""
import gc, json, sys
import numpy as np
import ump
if sys.argv[1] == "cupy-first":
    import cupy
    early = cupy.cuda.Stream(non_blocking=True)
scans = []
referrers = gc.get_referrers
gc.get_referrers = lambda *a: scans.append(1) or referrers(*a)
ump.enable(sys.argv[2], cap=1 << 30)
import cupy
sides = ump._enable.current().cupy.side_streams
before = sides.seen
kernel = cupy.RawKernel(r'''{SPIN}''', "spin_then_write")
g = cupy.zeros(1 << 16, dtype=cupy.float64)
values, seen = [], []
for make in (lambda: cupy.cuda.Stream.null, cupy.cuda.Stream, lambda: cupy.cuda.Stream(non_blocking=True)):
    stream = make()  # made just before its kernels
    for value in (1.0, 2.0, 3.0):
        with stream:
            kernel(((g.size + 255) // 256,), (256,), (g, np.int64(g.size), np.int64({CYCLES}),
                                                      np.float64(value)))
        values.append(float(g[-1]))
    seen.append(sides.seen)
one_gpu = ump._enable.current().cupy.release.one_gpu()
print(json.dumps([before, len(scans), seen, values, one_gpu]))
"""
    name, _ = gpu_backend
    if name != "managed":
        pytest.skip("a scalar read queues its copy before the wait in managed memory only")
    out = {}
    for order in ("ump-first", "cupy-first"):
        proc = subprocess.run([sys.executable, "-c", code, order, name], capture_output=True, text=True,
                              cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[order] = json.loads(proc.stdout.strip().splitlines()[-1])
    one_gpu = out["ump-first"].pop()
    values = [1.0, 2.0, 3.0] * 3
    # the non-blocking stream is noted as it is made, the blocking one is followed
    assert out["ump-first"] == [False, 0, [False, False, True], values]
    # with several GPUs every read waits first, and asks nothing
    expected = [None, 1, [True, True, True]] if one_gpu else [None, 0, [None, None, True]]
    assert out["cupy-first"] == [*expected, values, one_gpu]


@pytest.mark.parametrize("path", ["cupy.asnumpy", "numpy.asarray"])
def test_a_copy_into_another_gpu_is_finished_before_the_host_reads(gpu_backend, path):
    """CuPy copies into an array of GPU 1 with a kernel on the current GPU 0,
    queued on a non-blocking stream behind a spinning kernel: GPU 1 has
    nothing queued, so a read that waited for the array's own GPU alone
    would see the old values (CuPy's test_copyto_multigpu)."""
    name, cupy = gpu_backend
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    read = _host_readers(cupy)[path][0]
    with cupy.cuda.Device(1):
        b = cupy.zeros(N, dtype=cupy.float64)
        cupy.cuda.Device(1).synchronize()
    a = cupy.zeros(N, dtype=cupy.float64)  # on GPU 0
    stream = cupy.cuda.Stream(non_blocking=True)
    for i in range(1, ROUNDS + 1):
        _race(cupy, a, stream, float(i))
        with stream, warnings.catch_warnings():
            warnings.simplefilter("ignore", cupy._util.PerformanceWarning)  # peer access enabled
            cupy.copyto(b, a)
        out = read(b)  # at once: the copy waits behind the spinning kernel
        assert b.device.id == 1 and (out == i).all(), f"round {i}: read before GPU 0's copy finished"


def test_cuda_array_interface_waits_for_the_kernel(gpu_backend, record):
    """A GPU library reading through __cuda_array_interface__ on its own
    stream sees the kernel's values (torch.as_tensor)."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    name, cupy = gpu_backend
    stream = cupy.cuda.Stream(non_blocking=True)
    g = cupy.zeros(N, dtype=cupy.float64)
    for i in range(1, ROUNDS + 1):
        _race(cupy, g, stream, float(i))
        t = torch.as_tensor(g, device="cuda")
        assert t.data_ptr() == g.data.ptr
        assert float(t.min()) == i and float(t.max()) == i, f"round {i}"
    record(path="torch.as_tensor (__cuda_array_interface__)", backend=name, result="shares", waits=ROUNDS)


def test_dlpack_to_torch_waits_and_is_accepted(gpu_backend, record):
    """Managed memory reaches PyTorch as kDLCUDA (it refuses kDLCUDAManaged),
    at the same address, after the kernel."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    name, cupy = gpu_backend
    stream = cupy.cuda.Stream(non_blocking=True)
    g = cupy.zeros(N, dtype=cupy.float64)
    assert g.__dlpack_device__() == (2, 0)
    for i in range(1, ROUNDS + 1):
        _race(cupy, g, stream, float(i))
        t = torch.from_dlpack(g)
        assert t.device.type == "cuda" and t.data_ptr() == g.data.ptr
        assert float(t.min()) == i and float(t.max()) == i, f"round {i}"
    record(path="torch.from_dlpack", backend=name, result="shares", waits=ROUNDS)


def test_from_dlpack_of_a_fresh_kernel_result(gpu_backend):
    """The defect as users met it: np.from_dlpack right after CuPy kernels."""
    name, cupy = gpu_backend
    read = np.from_dlpack if name != "device" else (lambda g: np.from_dlpack(g, copy=True))
    assert int(read(cupy.arange(1000)).sum()) == 499500
    for _ in range(ROUNDS):
        g = cupy.arange(1 << 22, dtype=cupy.int64) * 2
        assert int(read(g)[-1]) == ((1 << 22) - 1) * 2


def test_torch_both_ways(gpu_backend):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    name, cupy = gpu_backend
    g = cupy.arange(1 << 16, dtype=cupy.float32)
    t = torch.from_dlpack(g)
    assert t.data_ptr() == g.data.ptr
    t.mul_(2)  # PyTorch's kernel, on its stream
    torch.cuda.synchronize()
    host = cupy.asnumpy(g)  # CuPy and NumPy see PyTorch's write
    assert host[5] == 10.0
    if name != "device":  # cupy.asnumpy copies small results on managed memory; these share
        assert np.asarray(g).ctypes.data == g.data.ptr == ump.asnumpy(g).ctypes.data
    back = cupy.from_dlpack(t)  # and back: the same memory
    assert back.data.ptr == g.data.ptr
    # PyTorch's own memory into CuPy and NumPy, as with stock CuPy
    own = torch.arange(1000, device="cuda", dtype=torch.float64)
    c = cupy.from_dlpack(own)
    assert c.data.ptr == own.data_ptr() and ump.kind_of(c) is None
    np.testing.assert_array_equal(cupy.asnumpy(c), own.cpu().numpy())
    c2 = cupy.asarray(own)  # through __cuda_array_interface__
    assert c2.data.ptr == own.data_ptr()
    np.testing.assert_array_equal(np.asarray(c2), np.arange(1000.0))


SPIN_F32 = SPIN.replace("double *x", "float *x").replace("double value", "float value")


def test_jax_both_ways(gpu_backend, record):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    name, cupy = gpu_backend
    stream = cupy.cuda.Stream(non_blocking=True)
    g = cupy.zeros(N, dtype=cupy.float32)
    spin = cupy.RawKernel(SPIN_F32, "spin_then_write")
    shared = set()
    for i in range(1, 6):
        with stream:
            spin(((N + 255) // 256,), (256,), (g, np.int64(N), np.int64(CYCLES), np.float32(i)))
        j = jnp.from_dlpack(g)
        shared.add(j.unsafe_buffer_pointer() == g.data.ptr)
        assert float(j.min()) == i and float(j.max()) == i, f"round {i}"
    own = jnp.arange(1000, dtype=jnp.float32)
    c = cupy.from_dlpack(own)
    np.testing.assert_array_equal(cupy.asnumpy(c), np.arange(1000, dtype=np.float32))
    record(path="jax.numpy.from_dlpack", backend=name, result="shares" if shared == {True} else "copies",
           waits=5)


def test_numba_both_ways(gpu_backend, record):
    cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    name, cupy = gpu_backend
    stream = cupy.cuda.Stream(non_blocking=True)
    g = cupy.zeros(N, dtype=cupy.float64)
    for i in range(1, 6):
        _race(cupy, g, stream, float(i))
        d = cuda.as_cuda_array(g)
        assert d.device_ctypes_pointer.value == g.data.ptr
        assert (d.copy_to_host() == i).all(), f"round {i}"
    # The interface names no stream (the wait is done): Numba's copy_to_host()
    # then copies synchronously, as into stock NumPy's pageable memory. On a
    # stream named there it would return before 64 MiB had reached ump's
    # pinned NumPy memory.
    assert g.__cuda_array_interface__["stream"] is None
    big = cupy.empty(8 << 20, dtype=cupy.float64)
    for i in range(1, 4):
        with stream:
            big.fill(float(i))
        h = cuda.as_cuda_array(big).copy_to_host()
        assert h[-1] == i and (h == i).all(), f"64 MiB, round {i}"
    own = cuda.to_device(np.arange(100.0))
    c = cupy.asarray(own)
    assert c.data.ptr == own.device_ctypes_pointer.value
    np.testing.assert_array_equal(cupy.asnumpy(c), np.arange(100.0))
    record(path="numba.cuda.as_cuda_array", backend=name, result="shares", waits=5)


@pytest.mark.filterwarnings("ignore:cupyx.allow_synchronize will be removed:UserWarning")
def test_waits_are_declared_to_cupys_sync_detection(gpu_backend):
    """On the unified backends get() and asnumpy() are ump's own waits (on
    ``device`` CuPy's copy declares too); the interface is ump's on all."""
    import cupyx

    name, cupy = gpu_backend
    g = cupy.arange(4.0)
    with cupyx.allow_synchronize(False):
        for read in (lambda: g.get(), lambda: cupy.asnumpy(g), lambda: g.__cuda_array_interface__):
            with pytest.raises(cupyx.DeviceSynchronized):
                read()
    assert g.get()[3] == 3.0


def test_a_graph_capture_survives_host_reads_refused_and_takes_zero_copy_arrays(gpu_backend, monkeypatch):
    """CuPy refuses a host transfer while the current stream captures a
    graph, before any CUDA call; a device-wide wait then would invalidate the
    capture (CuPy's test_graph.py, test_stream_capture_failure3 and 5). A
    large block CuPy takes then is not prefetched, which would invalidate the
    capture too; after it, one is."""
    name, cupy = gpu_backend
    prefetched = []
    prefetch = ump._core.prefetch
    monkeypatch.setattr(ump._core, "prefetch", lambda ptr, size, *a: prefetched.append(size) or prefetch(ptr, size, *a))
    a = cupy.arange(1 << 20, dtype=cupy.float32)
    x = np.ones(4 << 20, np.float32)  # 16 MiB: a block the placement policy times from its hand-off
    s, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    assert (a.nbytes in prefetched) == (name == "managed")  # 4 MiB, before the capture
    prefetched.clear()
    with s:
        s.begin_capture()
        for read in (lambda: bool(a.sum() > 0), lambda: cupy.asnumpy(a), lambda: np.asarray(a),
                     lambda: a.get(stream=other)):  # a device-wide wait would stop the capture too
            with pytest.raises(RuntimeError, match="is capturing"):
                read()
        if name == "device":  # NumPy memory is host memory: a copy, which CuPy refuses now
            with pytest.raises(RuntimeError, match="is capturing"):
                cupy.asarray(x)
        else:
            gx = cupy.asarray(x)
            assert gx.data.ptr == x.ctypes.data
            gx *= 2
            # a GPU consumer waits for nothing: its work is captured on CuPy's stream
            assert gx.__cuda_array_interface__["stream"] == s.ptr
        big = cupy.empty(4 << 20, dtype=cupy.float32)  # 16 MiB, a fresh block
        big.fill(3)
        graph = s.end_capture()  # raises if the capture was invalidated
    assert not s.is_capturing()
    assert prefetched == []  # nothing was prefetched while the stream captured
    after = cupy.empty(5 << 20, dtype=cupy.float32)
    assert (after.nbytes in prefetched) == (name == "managed")
    assert x[0] == 1.0  # captured, not run
    graph.launch(s)
    s.synchronize()
    assert (x == (1.0 if name == "device" else 2.0)).all()
    assert cupy.asnumpy(a)[-1] == (1 << 20) - 1
    assert float(big[-1]) == 3.0
    if name != "device":
        # an event the policy had recorded during the capture could not be timed here
        assert (cupy.asnumpy(gx) == 2.0).all()


def test_structured_arrays_reach_the_host_with_their_dtype(gpu_backend):
    """Fields out of order (a field selection) have no array-interface descr."""
    name, cupy = gpu_backend
    a = cupy.ones(10, "i,f,i")
    a["f1"] = cupy.arange(10)
    a["f2"] = -cupy.arange(10)
    picked = a[["f2", "f1"]]
    h = cupy.asnumpy(picked)
    assert h.dtype == picked.dtype
    assert h["f2"].tolist() == [-k for k in range(10)] and h["f1"].tolist() == [float(k) for k in range(10)]
    assert cupy.asnumpy(a).dtype == a.dtype


def test_dlpack_arguments(gpu_backend):
    name, cupy = gpu_backend
    g = cupy.arange(10, dtype=cupy.float64)
    copied = np.from_dlpack(g, copy=True)
    assert copied.ctypes.data != g.data.ptr and copied[3] == 3.0
    if name == "device":
        with pytest.raises((BufferError, ValueError)):
            np.from_dlpack(g, copy=False)
    else:
        shared = np.from_dlpack(g, copy=False)
        assert shared.ctypes.data == g.data.ptr
        on_cpu = np.from_dlpack(g, device="cpu")  # dl_device=(kDLCPU, 0)
        assert on_cpu.ctypes.data == g.data.ptr and on_cpu[9] == 9.0


def test_host_views_keep_the_exact_dtype(gpu_backend):
    """NumPy rebuilds a dtype from the array interface's typestr, which names
    a size, not a C type; the host view keeps CuPy's dtype (longlong stays
    longlong: it prints differently from int64)."""
    name, cupy = gpu_backend
    for dt in (np.longlong, np.ulonglong, np.intc, np.int64, np.float16, np.complex64):
        h = cupy.asnumpy(cupy.arange(5, dtype=dt))
        assert h.dtype.char == np.dtype(dt).char
        assert repr(h) == repr(np.arange(5, dtype=dt))
