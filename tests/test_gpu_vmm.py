"""VMM device pools on a real GPU: cuMemCreate/cuMemMap under CuPy.

Run with CUPY_ENABLE_UMP=1 on a CUDA machine; skipped elsewhere. The
two-GPU tests (peer access, migration) skip on a machine with one GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import ump
from ump import _core

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def cupy(gpu_caps):
    if not gpu_caps.devices[0].vmm_supported:
        pytest.skip(f"{gpu_caps.devices[0].name} does not support VMM")
    from ump._cupy_compat import import_cupy

    return import_cupy()  # CuPy's own UMP path off, as ump.enable() imports it


@pytest.fixture
def pool(cupy):
    p = ump.VMMPool(0, limit=8 << 30)
    saved = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(p.malloc)
    yield p
    cupy.cuda.set_allocator(saved)
    cupy.cuda.runtime.deviceSynchronize()
    import gc

    gc.collect()
    _core.fault_inject(0, 0)
    if p.statistics().current_count == 0:
        p.close()


def _free_device_bytes():
    from cuda.bindings import driver

    err, free, _ = driver.cuMemGetInfo()
    assert err == driver.CUresult.CUDA_SUCCESS
    return int(free)


def test_cupy_operations_on_pool_memory(cupy, pool):
    a = cupy.arange(1 << 20, dtype=cupy.float32)
    b = cupy.ones((1024, 1024), dtype=cupy.float64)
    assert ump.kind_of(a) == "device" and ump.kind_of(b) == "device"
    assert _core.lookup(a.data.ptr)[0] == "device"
    c = (a.reshape(1024, 1024) * 2 + b) @ b[:, :8]
    expect = (np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024) * 2 + 1) @ np.ones((1024, 8))
    np.testing.assert_allclose(cupy.asnumpy(c), expect, rtol=1e-5)
    idx = cupy.asarray([5, 1, 1023])
    assert a[idx].tolist() == [5.0, 1.0, 1023.0]
    assert cupy.concatenate([a[:3], a[-2:]]).tolist() == [0, 1, 2, 1048574, 1048575]
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        d = cupy.full(1000, 3, dtype=cupy.int32)
        assert int(d.sum()) == 3000
    st = pool.statistics()
    assert st.current_count >= 4 and st.physical_bytes >= st.used_bytes > 0


def test_growth_reuse_and_statistics(cupy, pool):
    arrays = [cupy.empty(2 * MiB, dtype=cupy.uint8) for _ in range(16)]
    st = pool.statistics()
    assert st.mapped_bytes >= 32 * MiB and st.handles_created >= 16
    del arrays
    assert pool.trim(keep_handles=True) >= 32 * MiB
    created = pool.statistics().handles_created
    arrays = [cupy.full(2 * MiB, 7, dtype=cupy.uint8) for _ in range(16)]
    st = pool.statistics()
    assert st.handles_created == created  # mapped from the cache, no cuMemCreate
    assert all(int(x[-1]) == 7 for x in arrays)
    assert st.peak_used_bytes >= 32 * MiB and st.total_count >= 32


@pytest.mark.serial
def test_trim_gives_memory_back_to_the_driver(cupy, pool):
    cupy.cuda.runtime.deviceSynchronize()
    pool.trim()
    base = _free_device_bytes()
    arrays = [cupy.ones(n * MiB // 4, dtype=cupy.float32) for n in (64, 256, 130, 33)]
    used = _free_device_bytes()
    assert base - used >= 480 * MiB
    del arrays
    held = pool.statistics().physical_bytes
    released = pool.trim()
    assert released == held and pool.statistics().physical_bytes == 0
    back = _free_device_bytes() - used
    assert back >= 0.95 * (base - used)


def test_cupy_allocations_past_the_limit_get_cupys_error(cupy, pool):
    """The limit itself is test_vmm.py's (on both physical layers); here
    CuPy's allocator interface: past the limit, after CuPy's recovery, the
    error is the class CuPy users catch, naming the limit."""
    pool.set_limit(64 * MiB)
    x = cupy.ones(48 * MiB // 4, dtype=cupy.float32)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError, match="limit 67108864") as info:
        cupy.empty(32 * MiB, dtype=cupy.uint8)
    assert isinstance(info.value, ump.OutOfMemoryError)
    assert float(x.sum()) == 48 * MiB // 4  # nothing lost
    del x
    y = cupy.zeros(60 * MiB, dtype=cupy.uint8)  # the freed memory serves the next one
    assert int(y[-1]) == 0
    assert pool.statistics().physical_bytes <= 64 * MiB


def test_growable_buffer_under_a_kernel(cupy, pool):
    buf = pool.buffer(1 << 30, 4 * MiB)
    a = buf.array((MiB,), "float32")
    a[:] = 1.5
    ptr = buf.ptr
    buf.resize(64 * MiB)
    assert buf.ptr == ptr
    b = buf.array((16 * MiB,), "float32")
    assert b.data.ptr == a.data.ptr
    assert float(b[: MiB].sum()) == 1.5 * MiB  # the old contents, at the same address
    b[MiB:] = 2
    assert float(b.sum()) == 1.5 * MiB + 2 * 15 * MiB
    with pytest.raises(ValueError, match="does not fit"):
        buf.array((32 * MiB,), "float32")
    del a, b
    buf.close()


def test_enable_device_backend(cupy, gpu_caps):
    assert ump.enable("device", cap=2 << 30) == "device"
    a = np.arange(6 << 20, dtype=np.float32)
    assert ump.kind_of(a) == "pinned"  # NumPy side: pinned, for one-DMA copies
    g = cupy.asarray(a)
    assert ump.kind_of(g) == "device"
    assert g.data.ptr != a.ctypes.data  # a copy
    a[0] = -1  # the copy is complete and independent
    assert float(g[0]) == 0.0 and float(g[-1]) == (6 << 20) - 1
    g *= 2
    h = cupy.asnumpy(g)
    assert ump.kind_of(h) == "pinned"
    np.testing.assert_array_equal(h[1:], np.arange(1, 6 << 20, dtype=np.float32) * 2)
    assert ump.asnumpy(ump.asarray(a[::2])).tolist()[:3] == [-1.0, 2.0, 4.0]  # strided: CuPy's path
    c = np.asarray(g)  # device memory: no host view, so a copy after the wait
    assert c.ctypes.data != g.data.ptr and c[5] == 10.0
    with pytest.raises(ValueError, match="device memory"):
        np.asarray(g, copy=False)
    st = ump.statistics()["pool"]
    assert st.used_bytes >= 24 << 20  # g
    del g
    ump.trim()
    assert ump.statistics()["pool"].used_bytes < 24 << 20
    ump.disable()
    assert cupy.ones(3).sum() == 3  # CuPy's own allocator again


def test_cupy_suite_recipe_with_device_backend(cupy):
    """What tools/cupy_suite.py does with UMP_SUITE_BACKEND=device: enable,
    run CuPy code, and the pool serves it."""
    ump.enable("device", cap=1 << 30)
    x = cupy.linspace(0, 1, 1000)
    assert abs(float(x.mean()) - 0.5) < 1e-12
    assert ump.kind_of(x) == "device"


# --- two GPUs ------------------------------------------------------------------

@pytest.fixture
def two_gpus(cupy, gpu_caps):
    if len(gpu_caps.devices) < 2:
        pytest.skip("needs two GPUs")
    from cuda.bindings import driver

    err, can = driver.cuDeviceCanAccessPeer(1, 0)
    if not can:
        pytest.skip("GPU 1 cannot access GPU 0's memory")
    return cupy


def _on_device(cupy, g, device):
    """A view of g's memory that CuPy treats as living on `device`."""
    mem = cupy.cuda.memory.UnownedMemory(g.data.ptr, g.nbytes, g, device)
    return cupy.ndarray(g.shape, g.dtype, cupy.cuda.MemoryPointer(mem, 0))


def test_peer_access_without_enable_peer_access(two_gpus, pool):
    cupy = two_gpus
    g = cupy.arange(4 << 20, dtype=cupy.float32)
    pool.grant(1)
    assert pool.devices == (0, 1)
    cupy.cuda.runtime.deviceSynchronize()  # GPU 1 does not wait for GPU 0's stream
    with cupy.cuda.Device(1):
        v = _on_device(cupy, g, 1)
        total = float((v * 2).sum())  # a kernel on GPU 1 reads GPU 0's pool
    assert total == float(g.sum()) * 2


def test_migrate_to_second_gpu_keeps_address(two_gpus, pool):
    cupy = two_gpus
    g = cupy.arange(8 << 20, dtype=cupy.float32) % 1000
    expect = float(g.sum())
    ptr = g.data.ptr
    moved = ump.migrate(g, 1)
    assert moved.data.ptr == ptr and moved.data.device_id == 1
    assert pool.device_of(ptr, g.nbytes) == 1
    assert pool.statistics().migrations >= 1
    with cupy.cuda.Device(1):
        assert float(moved.sum()) == expect  # kernel on GPU 1, unchanged address
        moved *= 2
    cupy.cuda.Device(1).synchronize()
    assert float(g.sum()) == 2 * expect  # GPU 0 still reaches it
    back = ump.migrate(g, 0)
    assert back is g and pool.device_of(ptr, g.nbytes) == 0
    assert float(g.sum()) == 2 * expect


def test_migrate_bad_input(cupy, pool, gpu_caps):
    g = cupy.ones(1000)
    with pytest.raises(ValueError, match="does not exist"):
        ump.migrate(g, len(gpu_caps.devices) + 5)
    with pytest.raises(ValueError, match="non-negative"):
        ump.migrate(g, -1)
    with pytest.raises(ump.UmpError, match="VMM pool"):
        ump.migrate(np.ones(10), 0)
    with pytest.raises(TypeError):
        ump.migrate(object(), 0)


_SLOW_SUM = r"""
extern "C" __global__ void slow_sum(const int *a, unsigned long long n, unsigned long long wait_ns,
                                    unsigned long long *out)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < wait_ns);
    unsigned long long s = 0;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        s += a[i];
    atomicAdd(out, s);
}
"""


def _view(cupy, ptr, nbytes, dtype, device):
    mem = cupy.cuda.memory.UnownedMemory(ptr, nbytes, None, device)
    return cupy.ndarray((nbytes // np.dtype(dtype).itemsize,), dtype, cupy.cuda.MemoryPointer(mem, 0))


def test_unmapping_waits_for_kernels_on_granted_devices(two_gpus, pool):
    """A kernel on GPU 1 still reads a block of GPU 0's pool when the block is
    freed; the next allocation scavenges the block's idle memory and unmaps
    it. That unmap must wait for GPU 1 as well as GPU 0, or the kernel reads
    unmapped addresses (an illegal address error on GPU 1)."""
    cupy = two_gpus
    n = 2 << 20
    nbytes = 4 * n  # 8 MiB of int32: granules 0-3 of the fresh pool
    host = (np.arange(n) % 7).astype(np.int32)
    pool.grant(1)
    ptr = pool.allocate(nbytes)
    out = pool.allocate(512)  # after it, so its hole never merges with the top; the sum lands here
    assert out == ptr + nbytes
    _view(cupy, ptr, nbytes, np.int32, 0).set(host)
    cupy.cuda.runtime.memset(out, 0, 8)
    cupy.cuda.runtime.deviceSynchronize()
    with cupy.cuda.Device(1):
        kernel = cupy.RawKernel(_SLOW_SUM, "slow_sum")
        kernel((32,), (256,), (_view(cupy, ptr, nbytes, np.int32, 1), np.uint64(n),
                               np.uint64(500_000_000), _view(cupy, out, 512, np.uint64, 1)))
    # the kernel now waits half a second before it reads
    before = pool.statistics()
    pool.deallocate(ptr)
    big = pool.allocate(32 * MiB)  # fits no hole: mapped from ptr's idle handles, unmapped first
    assert pool.statistics().unmaps > before.unmaps
    cupy.cuda.Device(1).synchronize()  # raises if the kernel faulted
    total = int(_view(cupy, out, 512, np.uint64, 0)[:1].get()[0])
    assert total == int(host.sum())
    pool.deallocate(big)
    pool.deallocate(out)
