"""Unified arrays on a real GPU with real CuPy: identity, copies, sync, caps.

Run with CUPY_ENABLE_UMP=1 on a CUDA machine; skipped elsewhere.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import subprocess
import sys

import numpy as np
import pytest

import ump
from _gpu import require_backend
from _threads import run_threads

pytestmark = pytest.mark.gpu

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
          np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]

# A kernel that runs long enough (~100 ms) for a host read to race it.
SPIN = r"""
extern "C" __global__ void spin_then_write(double *x, long n, long long cycles) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    long long start = clock64();
    while (clock64() - start < cycles) {}
    if (i < n) x[i] = x[i] * 2.0 + 1.0;
}
"""


def _spin(cupy):
    return cupy.RawKernel(SPIN, "spin_then_write")


def _launch_spin(cupy, g, cycles=200_000_000):
    kernel = _spin(cupy)
    n = g.size
    kernel(((n + 255) // 256,), (256,), (g, np.int64(n), np.int64(cycles)))


def test_stock_cupy_asserts_without_sam(gpu_caps):
    """The problem ump solves: CuPy's own UMP path fails on GPUs without SAM."""
    if gpu_caps.devices[0].pageable_memory_access:
        pytest.skip("this GPU has SAM: stock CuPy's UMP path works here")
    code = "import cupy; cupy.array([1, 2, 3])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "CUPY_ENABLE_UMP": "1"})
    assert run.returncode != 0 and "AssertionError" in run.stderr


def test_enable_makes_cupy_work(gpu_backend):
    name, cupy = gpu_backend
    assert cupy.array([1, 2, 3]).tolist() == [1, 2, 3]
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    g = cupy.asarray(a)
    assert ump.kind_of(a) == name
    assert g.data.ptr == a.ctypes.data
    assert (g.sum() == a.sum()).item()
    # CuPy internals that build arrays from host lists (fancy indexing,
    # concatenate's pointer tables) keep working with CUPY_ENABLE_UMP=1.
    assert g[[0, 2]].shape == (2, 4)
    assert cupy.concatenate([g, g, g]).shape == (9, 4)
    assert (g @ g.T).shape == (3, 3)


def test_numpy_cupy_numpy_same_address(gpu_backend):
    _, cupy = gpu_backend
    a = np.arange(1 << 20, dtype=np.float64)
    g = cupy.asarray(a)
    assert g.data.ptr == a.ctypes.data
    g *= 2
    b = cupy.asnumpy(g)
    assert b.ctypes.data == a.ctypes.data
    assert b[5] == 10.0 and a[7] == 14.0
    c = g.get()
    assert c.ctypes.data == a.ctypes.data
    d = np.asarray(g)
    assert d.ctypes.data == a.ctypes.data
    e = cupy.array(a, copy=False)
    assert e.data.ptr == a.ctypes.data


def test_cupy_numpy_cupy_same_address(gpu_backend):
    name, cupy = gpu_backend
    g = cupy.arange(1 << 20, dtype=cupy.float32)  # 4 MiB: CuPy's smaller results in managed memory are copied
    assert ump.kind_of(g) == name
    b = cupy.asnumpy(g)
    assert b.ctypes.data == g.data.ptr
    assert b[100] == 100.0
    g2 = cupy.asarray(b)
    assert g2.data.ptr == g.data.ptr
    g2 += 1
    assert cupy.asnumpy(g2)[100] == 101.0 and b[100] == 101.0


def test_releasing_round_trips_of_several_arrays_does_not_hang(gpu_backend):
    # Each host view from cupy.asnumpy holds a CuPy view that leased another
    # NumPy array: releasing one hands the queue the next while it releases.
    import threading

    _, cupy = gpu_backend
    xs = [np.ones(1 << 20) for _ in range(4)]
    for i in range(len(xs)):
        g = cupy.asarray(xs[i])
        g *= 2
        xs[i] = cupy.asnumpy(g)
        g2 = cupy.asarray(xs[i])
        g2 += 1
        xs[i] = cupy.asnumpy(g2)
    assert all(float(x[7]) == 3.0 for x in xs)
    del g, g2, xs
    for _ in range(2):
        waiter = threading.Thread(target=ump.synchronize, daemon=True)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "ump.synchronize() hung releasing NumPy memory"


def test_copy_true_copies(gpu_backend):
    _, cupy = gpu_backend
    a = np.ones(1000, dtype=np.int32)
    g = cupy.array(a)  # copy=True is CuPy's default
    assert g.data.ptr != a.ctypes.data
    g[:] = 7
    cupy.cuda.runtime.deviceSynchronize()
    assert a[0] == 1
    h = cupy.array(a, copy=True, dtype=np.float64)
    assert h.dtype == np.float64 and float(h[3]) == 1.0


def _stream(cupy, which):
    """The stream a test runs its work on: the default one or a non-blocking one."""
    return cupy.cuda.Stream(non_blocking=True) if which == "non_blocking" else cupy.cuda.Stream.null


@pytest.mark.parametrize("which", ["default", "non_blocking"])
@pytest.mark.parametrize("how", ["array", "blocking", "order"])
def test_a_copy_cupy_makes_on_the_gpu_has_read_the_numpy_array_when_it_returns(gpu_backend, how, which):
    # The copy reads the NumPy array in place, queued behind ~100 ms of other
    # work on the current stream; the host writes the array as soon as the
    # call returns, as it may with stock CuPy, which copies from pageable
    # memory before returning.
    _, cupy = gpu_backend
    with _stream(cupy, which):
        for _ in range(5):
            a = np.arange(1 << 22, dtype=np.float64)  # 32 MiB
            _launch_spin(cupy, cupy.zeros(1, dtype=np.float64))
            if how == "array":
                g = cupy.array(a)  # copy=True is CuPy's default
            elif how == "blocking":
                g = cupy.array(a, blocking=True)
            else:
                g = cupy.asarray(a.reshape(2048, 2048), order="F")
            a[:] = -1
            assert g.data.ptr != a.ctypes.data
            assert bool((g.ravel(order="C") == cupy.arange(1 << 22, dtype=np.float64)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtypes_zero_copy(gpu_backend, dtype):
    _, cupy = gpu_backend
    a = (np.arange(4096) % 2).astype(dtype)
    g = cupy.asarray(a)
    assert g.data.ptr == a.ctypes.data and g.dtype == a.dtype
    g2 = g + g
    np.testing.assert_array_equal(cupy.asnumpy(g2), a + a)


@pytest.mark.parametrize("view", ["step", "offset", "transpose", "reverse", "column"])
def test_views_zero_copy(gpu_backend, view):
    _, cupy = gpu_backend
    base = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    a = {"step": base[::2, ::3], "offset": base[5:, 7:], "transpose": base.T,
         "reverse": base[::-1, ::-1], "column": base[:, 3]}[view]
    g = cupy.asarray(a)
    assert g.data.ptr == a.__array_interface__["data"][0]
    assert g.strides == a.strides
    np.testing.assert_array_equal(cupy.asnumpy(g * 1), a)
    g *= 0
    cupy.cuda.runtime.deviceSynchronize()
    assert not a.any()


def test_foreign_and_misaligned_inputs_are_copied(gpu_backend):
    _, cupy = gpu_backend
    ump.disable()
    before = np.arange(100, dtype=np.float64)  # NumPy's own memory
    ump.enable(gpu_backend[0], cap=4 << 30)
    assert ump.kind_of(before) is None
    g = cupy.asarray(before)
    assert g.data.ptr != before.ctypes.data
    np.testing.assert_array_equal(cupy.asnumpy(g), before)
    raw = np.zeros(8 * 101, dtype=np.uint8)
    mis = raw[1:1 + 8 * 100].view(np.float64)  # not 8-byte aligned
    mis[:] = np.arange(100)
    gm = cupy.asarray(mis)
    assert gm.data.ptr != mis.__array_interface__["data"][0]
    np.testing.assert_array_equal(cupy.asnumpy(gm), np.arange(100))
    ro = np.arange(10.0)
    ro.flags.writeable = False
    assert cupy.asarray(ro).data.ptr != ro.ctypes.data  # never write a read-only array


def test_host_read_after_kernel_on_other_stream(gpu_backend):
    _, cupy = gpu_backend
    a = np.ones(1 << 16, dtype=np.float64)
    g = cupy.asarray(a)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _launch_spin(cupy, g)
    out = cupy.asnumpy(g)  # must wait for the kernel on `stream`
    assert out.ctypes.data == a.ctypes.data
    assert (out == 3.0).all()


@pytest.mark.parametrize("which", ["default", "non_blocking"])
def test_numpy_block_not_reused_under_running_kernel(gpu_backend, which):
    _, cupy = gpu_backend
    n = 1 << 16
    with _stream(cupy, which):
        for _ in range(5):
            a = np.ones(n, dtype=np.float64)
            ptr = a.ctypes.data
            g = cupy.asarray(a)
            _launch_spin(cupy, g)  # still running when the arrays go away
            del a, g
            # The block must not be handed out again while the kernel runs.
            others = [np.full(n, 5.0) for _ in range(8)]
            assert all(o.ctypes.data != ptr for o in others)
            ump.synchronize()
            again = [np.empty(n) for _ in range(8)]
            assert any(o.ctypes.data == ptr for o in again)
            del others, again


def test_threads_allocate_at_once(gpu_backend):
    name, cupy = gpu_backend

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(50):
            a = rng.random(int(rng.integers(1, 300_000)))
            assert ump.kind_of(a) == name
            g = cupy.asarray(a)
            assert g.data.ptr == a.ctypes.data
            s = float((g * 2).sum())
            assert abs(s - 2 * a.sum()) <= 1e-6 * abs(s) + 1e-9

    errors = run_threads(work)
    assert not errors, errors


@pytest.mark.parametrize("name", ["managed", "pinned"])
def test_cap_exhaustion_and_fallback(gpu_caps, name):
    require_backend(gpu_caps, name)
    ump.enable(name, cap=96 << 20)
    import cupy

    keep = [np.ones(16 << 20, dtype=np.uint8) for _ in range(3)]  # 48 MiB in the arena
    assert all(ump.kind_of(k) == name for k in keep)
    over = np.ones(64 << 20, dtype=np.uint8)  # cannot fit: plain memory
    assert ump.kind_of(over) is None and over.sum() == 64 << 20
    part = over[: 16 << 20]
    g = cupy.asarray(part)  # copied (into the 48 MiB left), not shared
    assert g.data.ptr != part.ctypes.data and int(g.sum()) == 16 << 20
    del g
    if name == "managed":
        # managed memory lives on the GPU when CuPy uses it: the budget holds
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
            cupy.empty(128 << 20, dtype=np.uint8)
        assert isinstance(info.value, ump.OutOfMemoryError) and isinstance(info.value, MemoryError)
        assert f"CuPy asked for {128 << 20} bytes" in info.value.message
    else:
        # pinned memory is host memory: past the budget CuPy takes plain
        # device memory, as stock CuPy does, and conversions copy
        big = cupy.full(128 << 20, 7, dtype=np.uint8)
        assert ump.kind_of(big) is None and big.device.id == 0
        host = cupy.asnumpy(big)
        assert host.ctypes.data != big.data.ptr and int(host[::4096].sum()) == 7 * ((128 << 20) // 4096)
    assert all(int(k.sum()) == 16 << 20 for k in keep)  # nothing lost


def test_prefetch_and_advise_managed(gpu_caps):
    from ump import backends

    if backends.MANAGED.unavailable(gpu_caps, gpu_caps.devices[0]):
        pytest.skip("needs the managed backend")
    foreign = np.zeros(3)  # NumPy's own memory, made before enable()
    ump.enable("managed", cap=4 << 30)
    import cupy

    a = np.ones(8 << 20, dtype=np.float32)
    ump.prefetch(a, to="gpu")
    g = cupy.asarray(a)
    g *= 3
    ump.prefetch(g, to="host")
    assert cupy.asnumpy(g)[123] == 3.0
    ump.advise(a, "read_mostly")
    ump.advise(a, "unset_read_mostly")
    with pytest.raises(ValueError, match="unknown advice"):
        ump.advise(a, "fast")
    with pytest.raises(ump.UmpError, match="managed memory"):
        ump.prefetch(foreign, to="gpu")


@pytest.mark.serial
def test_placement_auto_migrates_blocks_the_gpu_works_on(gpu_caps):
    """Serial: the rule times the GPU with events, and kernels of other test
    processes sharing the GPU would count as this block's work."""
    from ump import backends

    if backends.MANAGED.unavailable(gpu_caps, gpu_caps.devices[0]):
        pytest.skip("needs the managed backend")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement

    def state(arr):
        _, base, size = ump._core.lookup(arr.ctypes.data)
        return placement.state(base, size)

    warm = cupy.ones(8)
    warm *= 2  # the kernel below is compiled: only its run counts
    quick = np.ones(16 << 20, dtype=np.float32)  # 64 MiB, one pass: cheaper than a migration
    g = cupy.asarray(quick)
    g *= 2
    assert cupy.asnumpy(g)[0] == 2.0
    assert (state(quick).on_gpu, state(quick).heavy) == (None, False)  # stays on the host
    cupy.asarray(quick)
    assert state(quick).on_gpu is None  # handed over again: still not migrated

    busy = np.ones(1 << 19, dtype=np.float64)  # 4 MiB, ~0.1 s of GPU time
    g = cupy.asarray(busy)
    _launch_spin(cupy, g)
    assert cupy.asnumpy(g)[0] == 3.0
    assert state(busy).heavy is True  # the GPU time beat a migration: heavy
    g = cupy.asarray(busy)
    assert state(busy).on_gpu == 0  # migrated to the current device at the next hand-off
    g *= 2
    b = cupy.asnumpy(g)
    assert state(busy).on_gpu is None and b[-1] == 6.0  # and brought back


@pytest.mark.serial
def test_placement_auto_puts_a_heavy_block_back_on_the_host_when_its_work_shrinks(gpu_caps):
    """Ten kernels per round trip make a 256 MiB block heavy; while they go
    on it stays heavy; a round trip of one kernel makes it host-resident
    again, and every read sees every kernel."""
    from ump import backends

    if backends.MANAGED.unavailable(gpu_caps, gpu_caps.devices[0]):
        pytest.skip("needs the managed backend")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    a = np.zeros(64 << 20, dtype=np.float32)  # 256 MiB: ten kernels ~64 ms over the link, ~3 ms in HBM
    _, base, size = ump._core.lookup(a.ctypes.data)
    warm = cupy.ones(8, dtype=np.float32)
    warm += 1  # compiled before anything is timed
    done, heavy, on_gpu = 0, [], []
    for kernels in (10, 10, 10, 1, 1):
        g = cupy.asarray(a)
        on_gpu.append(placement.state(base, size).on_gpu)
        for _ in range(kernels):
            g += 1
        done += kernels
        b = cupy.asnumpy(g)
        assert b.ctypes.data == a.ctypes.data and b[::1024].sum() == done * (b.size // 1024)
        heavy.append(placement.state(base, size).heavy)
    assert heavy == [True, True, True, False, False]
    assert on_gpu == [None, 0, 0, 0, None]  # migrated while heavy, then left on the host
    assert a.sum(dtype=np.float64) == done * a.size


def _event_wait(cupy):
    done = cupy.cuda.Event()
    done.record()
    done.synchronize()


PROGRAM_WAITS = {
    "stream": lambda cupy: cupy.cuda.get_current_stream().synchronize(),
    "event": _event_wait,
    "runtime": lambda cupy: cupy.cuda.runtime.deviceSynchronize(),
    "device": lambda cupy: cupy.cuda.Device().synchronize(),
}


@pytest.mark.serial
@pytest.mark.parametrize("wait", sorted(PROGRAM_WAITS))
def test_placement_auto_weighs_the_programs_own_waits(gpu_caps, wait):
    """A program that waits for the GPU itself (a stream's, an event's or
    the device's synchronize) before it reads leaves the export no wait of
    its own. Ten kernels over a 256 MiB block (~64 ms over the link)
    before that wait make it heavy all the same, and its next hand-off
    moves it; every read sees every kernel."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    if wait in ("device", "event") and cupy.cuda.runtime.getDeviceCount() != 1:
        pytest.skip("events and Device.synchronize() are weighed with one GPU only (they name no GPU "
                    "or may wait for another)")
    placement = ump._enable.current().cupy.placement
    a = np.zeros(64 << 20, dtype=np.float32)
    _, base, size = ump._core.lookup(a.ctypes.data)
    warm = cupy.ones(8, dtype=np.float32)
    warm += 1  # compiled before anything is timed
    on_gpu = []
    for done in (10, 20):
        g = cupy.asarray(a)
        on_gpu.append(placement.state(base, size).on_gpu)
        for _ in range(10):
            g += 1
        PROGRAM_WAITS[wait](cupy)
        b = cupy.asnumpy(g)
        assert b.ctypes.data == a.ctypes.data and b[::1024].sum() == done * (b.size // 1024)
        assert placement.state(base, size).heavy
    assert on_gpu == [None, 0]
    assert a.sum(dtype=np.float64) == 20.0 * a.size


@pytest.mark.serial
def test_reads_after_the_programs_own_wait_on_a_non_blocking_stream_see_every_kernel(gpu_caps):
    """Kernels on a non-blocking stream over a 256 MiB block the program
    holds, the program's wait for that stream, then the host reads the NumPy
    array in place, 20 rounds: the policy weighs each wait and moves the
    block meanwhile (a prefetch queued after the wait, on the current
    stream), and every read sees every kernel."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    stream = cupy.cuda.Stream(non_blocking=True)
    a = np.zeros(64 << 20, dtype=np.float32)
    _, base, size = ump._core.lookup(a.ctypes.data)
    g = cupy.asarray(a)
    moved = False
    for k in range(1, 21):
        with stream:
            for _ in range(5):
                g += 1
        stream.synchronize()
        assert a[0] == a[-1] == 5.0 * k and (a[::1024] == 5.0 * k).all(), \
            f"round {k}: read before the kernels ended"
        moved = moved or placement.state(base, size).on_gpu == 0
    assert moved  # the waits were weighed: the block went to the GPU on the way


@pytest.mark.serial
def test_placement_auto_moves_a_matrix_kernels_read_between_the_programs_own_waits(gpu_caps):
    """A solver's shape whose host synchronises each step instead of reading
    a scalar (``cupy.cuda.Device().synchronize()``, as timing loops do):
    the 32 MiB matrix each product reads over the link moves to the GPU
    after a few steps, and every product stays right."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    if cupy.cuda.runtime.getDeviceCount() != 1:
        pytest.skip("Device.synchronize() is weighed with one GPU only (ump takes its wait)")
    placement = ump._enable.current().cupy.placement
    A = np.ones((2048, 2048))
    _, base, size = ump._core.lookup(A.ctypes.data)
    warm = cupy.ones((8, 8)) @ cupy.ones(8)  # cuBLAS loaded before anything is timed
    float(warm[0])
    g = cupy.asarray(A)
    v = cupy.ones(A.shape[1], dtype=A.dtype)
    moved_at = None
    for step in range(60):
        w = g @ v
        cupy.cuda.Device().synchronize()
        if moved_at is None and placement.state(base, size).on_gpu == 0:
            moved_at = step
    assert moved_at is not None and moved_at < 40, moved_at
    assert float(w[0]) == float(w[-1]) == A.shape[1]


@pytest.mark.serial
def test_placement_auto_moves_a_new_block_of_a_heavy_blocks_size_at_its_first_hand_off(gpu_caps):
    """A loop that makes its next array before it drops the last one hands
    over two 256 MiB blocks in turn. Ten kernels over the link make the
    first heavy; the second moves at its first hand-off instead of paying
    that round trip again, and the loop's arrays then move each time, in
    whichever block the arena gives them. The kernels run on a non-blocking
    stream and the host reads at once from the default one: every read sees
    every kernel."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    stream = cupy.cuda.Stream(non_blocking=True)
    warm = cupy.ones(8, dtype=np.float32)
    warm *= 2  # compiled before anything is timed
    a, blocks, on_gpu = None, [], []
    for k in range(8):
        a = np.full(64 << 20, float(k), dtype=np.float32)  # made while the last one lives
        _, base, size = ump._core.lookup(a.ctypes.data)
        blocks.append(base)
        g = cupy.asarray(a)  # on the default stream
        on_gpu.append(placement.state(base, size).on_gpu)
        with stream:
            for _ in range(10):
                g *= 2
        b = cupy.asnumpy(g)  # at once, on the default stream
        assert b.ctypes.data == a.ctypes.data
        assert b[0] == b[-1] == k * 1024.0 and (b[::1024] == k * 1024.0).all(), \
            f"round {k}: read before the kernels ended"
        assert placement.state(base, size).heavy
    assert blocks[0] != blocks[1]  # the second is a block ump had not seen
    assert on_gpu == [None] + [0] * 7


@pytest.mark.serial
def test_a_heavy_block_is_read_only_after_a_non_default_stream_wrote_it(gpu_caps):
    """Kernels on a non-blocking stream over a 256 MiB block, read at once
    from the default stream: every read sees every kernel, while the block
    turns heavy, moves there and back on each round trip, and is
    host-resident again once the round trips shrink to one kernel."""
    from ump import backends

    if backends.MANAGED.unavailable(gpu_caps, gpu_caps.devices[0]):
        pytest.skip("needs the managed backend")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    a = np.zeros(64 << 20, dtype=np.float32)
    _, base, size = ump._core.lookup(a.ctypes.data)
    stream = cupy.cuda.Stream(non_blocking=True)
    done, heavy = 0, []
    for k, kernels in enumerate([10] * 20 + [1] * 20):
        g = cupy.asarray(a)  # on the default stream
        with stream:
            for _ in range(kernels):
                g += 1
        done += kernels
        b = cupy.asnumpy(g)  # at once, on the default stream
        assert b[0] == done and b[-1] == done and (b[::1024] == done).all(), \
            f"round {k}: read before the kernels ended"
        heavy.append(placement.state(base, size).heavy)
        del b
    # One kernel's round trip over 256 MiB took 0.25-0.27 ms on the GPU's
    # clock (H200), ump's steps up to the export's event included, against
    # the rule's 0.81 ms (under half a migration there and back, over the
    # link): a host stall in the first such round trip (once in one run)
    # leaves the verdict to the second.
    assert all(heavy[:20]) and not any(heavy[21:]), heavy
    assert a.sum(dtype=np.float64) == done * a.size


@pytest.mark.serial
def test_placement_auto_keeps_a_peeked_block_on_the_gpu(gpu_caps):
    """Handed to CuPy once, then steps of two memory-bound kernels and a
    host export of which the host reads 4 KiB: from the second export the
    block lives on the GPU, and every read still sees every kernel."""
    from ump import backends

    if backends.MANAGED.unavailable(gpu_caps, gpu_caps.devices[0]):
        pytest.skip("needs the managed backend")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    a = np.ones(64 << 20, dtype=np.float32)  # 256 MiB: ~13 ms a step over the link, ~0.3 ms in HBM
    _, base, size = ump._core.lookup(a.ctypes.data)
    g = cupy.asarray(a)
    g += 0  # compiled before anything is timed
    g *= 1
    on_gpu = []
    for step in range(8):
        g += 1
        g *= 1
        b = cupy.asnumpy(g)
        assert b[:1024].sum() == 1024 * (step + 2) and b.ctypes.data == a.ctypes.data
        on_gpu.append(placement.state(base, size).on_gpu)
    assert on_gpu[0] is None and on_gpu[1:] == [0] * 7  # moved at the second export, and stayed
    assert placement.state(base, size).peeked
    assert a[-1] == 9.0 and a.sum() == 9.0 * a.size  # NumPy reads all of it at the end


def _solve_loop(cupy, placement, A, steps, device=0):
    """A solver's shape (CuPy's examples/cg): a matrix handed over once, then
    steps of a product with it and a scalar read of another array. The
    step at which the matrix's block went to the GPU (None: never)."""
    _, base, size = ump._core.lookup(A.ctypes.data)
    g = cupy.asarray(A)
    v = cupy.ones(A.shape[1], dtype=A.dtype)
    moved_at = None
    for step in range(steps):
        w = g @ v
        assert float(w[-1]) == A.shape[1]  # a scalar of another array: the host waits
        if moved_at is None and placement.state(base, size).on_gpu == device:
            moved_at = step
    assert (base, size) not in placement.pending or moved_at is None
    return moved_at, placement.state(base, size), g


@pytest.mark.serial
def test_placement_auto_moves_a_matrix_kernels_read_between_scalar_reads(gpu_caps):
    """Serial: the rule weighs the host's waits, which other processes'
    kernels on the GPU would lengthen. 32 MiB read over the link by each
    product (~1.3 ms): the loss passes one way plus the host's faults
    (~7 ms) after a few steps, and the block moves to the GPU, while every
    product stays right; the export brings it back and it is heavy."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    A = np.ones((2048, 2048))
    warm = cupy.ones((8, 8)) @ cupy.ones(8)  # cuBLAS loaded before anything is timed
    float(warm[0])
    moved_at, state, g = _solve_loop(cupy, placement, A, 60)
    assert moved_at is not None and 2 <= moved_at < 40, moved_at
    assert state.synced
    g *= 2
    back = cupy.asnumpy(g)
    assert back.ctypes.data == A.ctypes.data and state.on_gpu is None and state.heavy
    assert A.sum() == 2.0 * A.size


@pytest.mark.serial
def test_placement_auto_leaves_a_single_pass_on_the_host(gpu_caps):
    """One kernel over 64 MiB, a scalar read of another array, then the
    host reads the block: it was weighed at the scalar read and stays on
    the host (one pass over the link costs less than any migration)."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    warm = cupy.ones(8, dtype=np.float32)
    warm *= 2
    float(warm.sum())
    a = np.ones(16 << 20, dtype=np.float32)
    _, base, size = ump._core.lookup(a.ctypes.data)
    g = cupy.asarray(a)
    assert (base, size) in placement.pending  # followed from its hand-off
    g *= 2
    assert float(g[:256].sum()) == 512.0  # another array's scalar: the host waits for the pass
    assert placement.state(base, size).on_gpu is None and (base, size) in placement.pending
    b = cupy.asnumpy(g)
    assert b[::1024].sum() == 2.0 * (b.size // 1024)
    state = placement.state(base, size)
    assert (state.on_gpu, state.heavy, state.synced) == (None, False, False)
    assert (base, size) not in placement.pending


def test_placement_auto_sends_a_result_the_host_read_back_to_the_gpu(gpu_caps):
    """CuPy's example finance/black_scholes: arrays CuPy made, read by NumPy
    through ``get()``, then read by kernels again. The next CuPy allocation
    prefetches them back (the driver's last prefetch location says the GPU),
    rather than each page the host read faulting back."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    x = cupy.random.rand(8 << 20)  # 64 MiB
    h = x.get()
    total = float(h.sum())  # the host reads all of it
    assert h.ctypes.data == x.data.ptr
    _, base, size = ump._core.lookup(x.data.ptr)
    ump.prefetch(x, to="host")  # as the host's reads left it, and seen by the driver
    assert _range_attribute(base, size, "LastPrefetchLocation") == -1
    y = x * 2
    assert _range_attribute(base, size, "LastPrefetchLocation") == 0
    assert float(y.sum()) == pytest.approx(2 * total)


def test_a_large_cupy_block_is_on_the_gpu_before_its_first_kernel(gpu_caps):
    """A kernel's first touch of managed memory faults each page over (~100
    ms per GiB on an H200, where device memory needs nothing): a block larger
    than 1 MiB that the arena hands CuPy's pool is prefetched to the GPU
    first, which the driver's last prefetch location shows before any kernel."""
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    pool = ump._enable.current().cupy.pool
    g = cupy.empty(16 << 20, dtype=cupy.float32)  # 64 MiB
    ump.prefetch(g, to="host")  # wherever the memory was before, the host now
    assert _range_attribute(g.data.ptr, g.nbytes, "LastPrefetchLocation") == -1
    del g
    pool.free_all_blocks()  # back to the arena: the next block is the arena's again
    g = cupy.empty(16 << 20, dtype=cupy.float32)
    assert _range_attribute(g.data.ptr, g.nbytes, "LastPrefetchLocation") == 0
    g.fill(3)
    assert float(g.sum()) == 3.0 * g.size


@pytest.mark.serial
def test_placement_auto_moves_a_matrix_to_the_device_its_view_lives_on(gpu_caps):
    """On GPU 1 (``cupy.cuda.Device(1)``): the waits counted are GPU 1's and
    the block moves to GPU 1, not to the current device of the process's
    start."""
    if len(gpu_caps.devices) < 2:
        pytest.skip("needs two GPUs")
    require_backend(gpu_caps, "managed")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    A = np.ones((2048, 2048))
    with cupy.cuda.Device(1):
        warm = cupy.ones((8, 8)) @ cupy.ones(8)
        float(warm[0])
        moved_at, state, _ = _solve_loop(cupy, placement, A, 60, device=1)
    assert moved_at is not None and state.device == 1 and state.on_gpu == 1
    assert placement.waits.get(1, 0.0) > 0.0
    assert _range_attribute(A.ctypes.data, A.nbytes, "LastPrefetchLocation") == 1


def _range_attribute(ptr: int, size: int, name: str) -> int:
    """cudaMemRangeAttribute<name> of a managed range, read from the driver:
    -1 the host, a device index, -2 none."""
    from cuda.bindings import runtime as rt

    err, value = rt.cudaMemRangeGetAttribute(4, getattr(rt.cudaMemRangeAttribute, f"cudaMemRangeAttribute{name}"),
                                             ptr, size)
    assert err == rt.cudaError_t.cudaSuccess, err
    return value


def _results_loop(cupy, n, lives, seen=None):
    """`lives` times: CuPy makes n float32, the host reads all of it. The
    last array, its block (base, size), and whether each life ended with the
    block host-mapped; ``seen`` gets a copy of its state after each export."""
    placement = ump._enable.current().cupy.placement
    mapped, g = [], None
    for _ in range(lives):
        g = None  # the previous life's array goes back to CuPy's pool first
        g = cupy.random.random(n, dtype=cupy.float32)
        b = cupy.asnumpy(g)
        assert b.ctypes.data == g.data.ptr  # still one address
        assert 0.49 < float(b.sum(dtype=np.float64)) / n < 0.51  # the host reads every page
        assert b[n // 3] == float(g[n // 3])
        _, base, size = ump._core.lookup(g.data.ptr)
        mapped.append((base, size) in placement.mapped)
        if seen is not None:
            state = placement.results.get((base, size))
            seen.append(state if state is None else dataclasses.replace(state))
        del b
    return g, (base, size), mapped


@pytest.mark.serial
def test_placement_auto_maps_a_result_the_host_reads_whole_in_host_memory(gpu_caps):
    """CuPy makes 256 MiB, the host reads all of it, again and again: at the
    second export (the GPU's write faulted back what the host had read) the
    block becomes host memory that the GPU writes over the link; two lives in
    a row not under half that export's wait send it back to the GPU for good.
    When CuPy's pool gives that memory to another array, and at disable(),
    it goes back to the GPU; the values are right throughout."""
    from ump import backends

    if backends.MANAGED.unavailable(gpu_caps, gpu_caps.devices[0]):
        pytest.skip("needs the managed backend")
    pytest.importorskip("cuda.bindings", reason="reads the advice back through cuda-bindings")
    ump.enable("managed", cap=4 << 30)
    import cupy

    hook = ump._enable.current().cupy
    placement = hook.placement
    n = 64 << 20  # 256 MiB of float32
    cupy.random.random(8, dtype=cupy.float32)  # the generator and its kernels, made once
    seen = []
    g, (base, size), mapped = _results_loop(cupy, n, 6, seen)
    del g
    assert mapped[:2] == [False, True], (mapped, seen)  # host-mapped at the second export
    slow = [2 * state.last_wait >= seen[1].trial_wait for state in seen]  # of lives 2 on
    pairs = [k for k in range(3, len(seen)) if slow[k - 1] and slow[k]]  # two slow lives in a row
    back = pairs[0] if pairs else len(mapped)  # where the rule sends it back to the GPU for good
    assert mapped == [False] + [True] * (back - 1) + [False] * (len(mapped) - back) and (
        back == len(mapped) or seen[back].retired), (mapped, seen)
    if back == len(mapped):  # the faster lives kept it there
        assert _range_attribute(base, size, "PreferredLocation") == -1  # host, in the driver's view
        assert cupy.cuda.get_allocator() == hook.allocator.watched_malloc

    other = cupy.empty(n // 2, dtype=cupy.float32)  # CuPy's pool splits the free block
    assert base <= other.data.ptr < base + size
    assert not placement.mapped and placement.results[(base, size)].retired, placement.results.get((base, size))
    assert _range_attribute(base, size, "PreferredLocation") == -2  # no advice left
    assert _range_attribute(base, size, "LastPrefetchLocation") == 0  # and moved to the GPU
    assert cupy.cuda.get_allocator() == hook.pool.malloc  # the watch is off again
    other[:] = 1
    other *= 3
    assert float(other.sum()) == 3.0 * other.size

    # disable() with a block host-mapped: back on the GPU, CuPy's allocator restored
    seen = []
    keep, (base2, size2), mapped = _results_loop(cupy, n // 2 + (1 << 20), 3, seen)
    assert mapped[-1] and base2 != base, (mapped, hex(base), hex(base2), seen)
    ump.disable()
    assert _range_attribute(base2, size2, "PreferredLocation") == -2
    assert _range_attribute(base2, size2, "LastPrefetchLocation") == 0
    assert cupy.cuda.get_allocator() == hook.allocator.saved
    keep[:] = 2  # an array from before disable() keeps working
    assert float(keep.sum()) == 2.0 * keep.size


@pytest.mark.serial
def test_a_host_mapped_result_is_read_only_after_a_non_default_stream_wrote_it(gpu_caps):
    """A result host-mapped by the placement, written again and again on a
    non-blocking stream and read at once from the default stream: each read
    sees the whole write, first while the GPU writes over the link, then
    across the move back to the GPU that a spinning writer brings about."""
    from ump import backends

    if backends.MANAGED.unavailable(gpu_caps, gpu_caps.devices[0]):
        pytest.skip("needs the managed backend")
    ump.enable("managed", cap=4 << 30)
    import cupy

    placement = ump._enable.current().cupy.placement
    n = 64 << 20  # 256 MiB of float32
    cupy.random.random(8, dtype=cupy.float32)
    g, block, mapped = _results_loop(cupy, n, 3)
    assert mapped[-1]
    stream = cupy.cuda.Stream(non_blocking=True)
    still_mapped = []
    for k in range(1, 21):
        g = None
        g = cupy.empty(n, dtype=cupy.float32)  # CuPy's pool hands the same block out again
        with stream:
            g.fill(k)  # 256 MiB over the link: ~5 ms
        b = cupy.asnumpy(g)  # at once, on the default stream
        assert b[0] == k and b[-1] == k and (b[::1024] == k).all(), f"round {k}: read before the write ended"
        still_mapped.append(block in placement.mapped)
        del b
    assert all(still_mapped), still_mapped
    _spin(cupy)  # compiled before the rounds
    for k in range(1, 4):
        g = None
        g = cupy.empty(n // 2, dtype=cupy.float64)  # the same bytes: the same block
        with stream:
            g.fill(k)
            _launch_spin(cupy, g, cycles=2_000_000)  # ~0.1 s in all, then x * 2 + 1
        b = cupy.asnumpy(g)
        assert b[0] == 2 * k + 1 and b[-1] == 2 * k + 1 and (b[::512] == 2 * k + 1).all(), \
            f"spinning round {k}: read before the kernel finished"
        del b
    assert block not in placement.mapped and placement.results[block].retired  # moved back on the way


def test_disable_restores_cupy(gpu_backend):
    name, cupy = gpu_backend
    a = np.arange(10.0)
    g = cupy.asarray(a)
    ump.disable()
    assert cupy.asarray(a).data.ptr != a.ctypes.data  # stock copy again
    assert float(g.sum()) == 45.0  # arrays from before keep working
    with pytest.raises(TypeError):
        np.asarray(cupy.arange(3))
    ump.enable(name, cap=4 << 30)


def test_asarray_options_applied_on_the_gpu(gpu_backend):
    _, cupy = gpu_backend
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert cupy.asarray(a, order="C").data.ptr == a.ctypes.data  # nothing to do: shared
    f = cupy.asarray(a, order="F")  # layout change: a GPU copy
    assert f.flags.f_contiguous and f.data.ptr != a.ctypes.data
    assert cupy.asarray(a, dtype=np.float64).dtype == np.float64
    assert cupy.array(a, copy=None, ndmin=4).shape == (1, 1, 4, 6)
    np.testing.assert_array_equal(cupy.asnumpy(f), a)


def test_provider_failures_with_cupy(gpu_backend):
    """Every chunk the providers would make fails: CuPy's side spills to
    plain device memory where the backend's memory is the host's, and fails
    cleanly where it is not; NumPy's side falls back to plain memory; what
    was made before is untouched."""
    name, cupy = gpu_backend
    spills = ump.backends.get(name).spills_to_device
    free, _ = cupy.cuda.runtime.memGetInfo()
    if spills and free < 1 << 30:
        pytest.skip(f"the spill to plain device memory needs 1 GiB free on the GPU; it has {free} bytes")
    keep = np.arange(1 << 16, dtype=np.float64)
    g_keep = cupy.asarray(keep) * 1  # a CuPy-owned array made before the faults
    ump.trim()
    ump._core.fault_inject(0, -1)  # every CUDA chunk allocation fails from now on
    try:
        if spills:
            spilled = cupy.full(256 << 20, 3, dtype=np.uint8)  # plain device memory, as stock CuPy
            assert ump.kind_of(spilled) is None and int(spilled[-1]) == 3
            del spilled
        else:
            with pytest.raises(ump.OutOfMemoryError, match="UMP_ERR_INJECTED"):
                cupy.empty(256 << 20, dtype=np.uint8)
        host = np.ones(64 << 20, dtype=np.uint8)  # NumPy falls back to plain memory
        assert ump.kind_of(host) is None and int(host[::4096].sum()) == (64 << 20) // 4096
        # A copy of plain host memory into CuPy's memory: plain device memory
        # where the backend spills; else a chunk ump already holds, if one has
        # room, or a clean failure naming the injected one.
        try:
            g = cupy.asarray(host[: 1 << 20])
        except ump.OutOfMemoryError as err:
            assert not spills and err.cuda_error == "UMP_ERR_INJECTED", err
        else:
            assert int(g.sum()) == 1 << 20
            del g
    finally:
        ump._core.fault_inject(0, 0)
    np.testing.assert_array_equal(cupy.asnumpy(g_keep), keep)  # nothing lost
    assert cupy.zeros(1 << 20).sum() == 0  # and the process keeps working


# Tests in the same process may have imported PyTorch or JAX, whose threads
# make Python >= 3.12 warn at fork(); the fork here is the point.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_fork_after_gpu_enable(gpu_backend, record_property):
    name, cupy = gpu_backend
    a = np.arange(1 << 16, dtype=np.int64)
    assert ump.kind_of(a) == name
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child must not call CUDA
        child = np.ones(1 << 20)  # new arrays: plain memory
        ok = ump.kind_of(child) is None and child.sum() == 1 << 20
        del a  # freeing an inherited block only updates metadata
        os.write(w, b"A" if ok else b"0")
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"A"
    assert int(cupy.asarray(a).sum()) == (1 << 16) * ((1 << 16) - 1) // 2


# Tests in the same process may have imported PyTorch or JAX, whose threads
# make Python >= 3.12 warn at fork(); the fork here is the point.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_fork_child_reading_inherited_unified_memory(gpu_backend, record_property):
    """Whether the driver maps inherited unified memory in a child: reported,
    since it is the driver's choice; the parent is unaffected either way."""
    name, cupy = gpu_backend
    a = np.arange(1 << 16, dtype=np.int64)
    pid = os.fork()
    if pid == 0:
        faulthandler.disable()  # a fault here is an answer, not a crash to report
        os._exit(0 if int(a.sum()) == (1 << 16) * ((1 << 16) - 1) // 2 else 1)
    _, status = os.waitpid(pid, 0)
    readable = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    record_property("child_reads_inherited", readable)
    print(f"\n{name}: a forked child {'can' if readable else 'cannot'} read inherited unified memory")
    assert int(a.sum()) == (1 << 16) * ((1 << 16) - 1) // 2


def test_backends_in_turn_and_enable_after_cupy_allocated(gpu_caps):
    from ump import backends

    names = [n for n in ("managed", "pinned")
             if backends.get(n).unavailable(gpu_caps, gpu_caps.devices[0]) is None]
    import cupy

    before = cupy.arange(1000)  # CuPy's own pool, before any enable()
    arrays = []
    for name in names * 2:
        ump.enable(name, cap=1 << 30)
        a = np.full(1 << 16, len(arrays), dtype=np.int32)
        g = cupy.asarray(a)
        assert ump.kind_of(a) == name and g.data.ptr == a.ctypes.data
        arrays.append((a, g))
        ump.disable()
    for i, (a, g) in enumerate(arrays):  # every array survives the switches
        assert int(g.sum()) == i * (1 << 16) and int(a[0]) == i
    assert int(before.sum()) == 999 * 1000 // 2
