"""Sharing VMM memory on a real GPU: the driver calls that the emulated tests
(test_vmm_share.py) stand in for — exportable handles, export and import of
POSIX file descriptors, inter-process events, one handle mapped twice,
striping over two GPUs.

Run with CUPY_ENABLE_UMP=1 on a CUDA machine; skipped elsewhere.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

import ump
import ump.share

pytestmark = pytest.mark.gpu

MiB = 1 << 20
CHILD_TIMEOUT = 120


@pytest.fixture
def cupy(vmm_cupy):
    return vmm_cupy


@pytest.fixture
def pool(cupy):
    p = ump.VMMPool(0, limit=4 << 30)
    yield p
    cupy.cuda.runtime.deviceSynchronize()
    import gc

    gc.collect()
    if p.statistics().views == 0 and p.statistics().current_count == 0:
        p.close()


def _gpu_importer(handle, conn, device):
    """Import the handle and, with a kernel on ``device``, check the
    exporter's 7s and add 1. Device 1 reaches GPU 0's memory through a
    pool of GPU 0 granted to it."""
    from ump._cupy_compat import import_cupy

    cp = import_cupy()
    pool = None
    if device != 0:
        pool = ump.VMMPool(0, reserve=handle.granularity)  # maps GPU 0's memory here
        pool.grant(device)
    mem = ump.import_handle(handle, pool, stream=cp.cuda.get_current_stream().ptr)
    handle.close()
    # The exporter's kernel is ordered by its event on GPU 0's stream; a
    # kernel on another GPU does not wait for that stream.
    cp.cuda.get_current_stream().synchronize()
    with cp.cuda.Device(device):
        a = (mem.array((handle.size // 4,), "float32") if device == 0
             else _array(cp, mem.ptr, handle.size, mem, device))
        ok = bool((a == 7).all())
        a += 1
        cp.cuda.Device(device).synchronize()
    conn.send(ok)
    conn.recv()
    del a
    mem.close()
    if pool is not None:
        pool.close()


def _share_with_a_process(cupy, pool, device):
    """Export 7s that a kernel is still writing to a spawned process whose
    kernel on ``device`` adds 1; see its writes here."""
    mem = pool.allocate_shared(8 * MiB)
    a = mem.array((2 * MiB,), "float32")
    a.fill(7)  # queued, not waited for: the exported event orders it
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    with mem.export(stream=cupy.cuda.get_current_stream().ptr) as handle:
        assert handle.event is not None and len(handle.event) == 64
        proc = ctx.Process(target=_gpu_importer, args=(handle, child, device))
        proc.start()
    assert parent.poll(CHILD_TIMEOUT) and parent.recv() is True
    assert float(a.sum()) == 8.0 * 2 * MiB  # the importer's kernel, seen here
    parent.send("done")
    proc.join(CHILD_TIMEOUT)
    assert proc.exitcode == 0
    del a
    mem.close()


def test_two_processes_share_device_memory(cupy, pool):
    _share_with_a_process(cupy, pool, 0)


def test_a_consumer_on_gpu_1_reads_gpu_0s_memory(cupy, pool, gpu_caps):
    if len(gpu_caps.devices) < 2:
        pytest.skip("needs two GPUs")
    _share_with_a_process(cupy, pool, 1)


def _gpu_exporter(address):
    from ump._cupy_compat import import_cupy

    cp = import_cupy()
    p = ump.VMMPool(0)
    mem = p.allocate_shared(4 * MiB)
    mem.array((MiB,), "int32")[:] = cp.arange(MiB, dtype=cp.int32)
    cp.cuda.runtime.deviceSynchronize()
    with ump.share.connect(address) as conn, mem.export() as handle:
        conn.send(handle)
        conn._sock.recv(1)


def test_the_exporter_exits_first(cupy, pool):
    ctx = multiprocessing.get_context("spawn")
    with ump.share.listen() as listener:
        proc = ctx.Process(target=_gpu_exporter, args=(listener.address,))
        proc.start()
        with listener.accept() as conn:
            with conn.recv() as handle:
                mem = pool.import_handle(handle)
            conn._sock.send(b"k")
        proc.join(CHILD_TIMEOUT)
    assert proc.exitcode == 0
    t = mem.setup_times  # each driver call of the import was timed
    assert min(t.reserve_ns, t.physical_ns, t.map_ns, t.access_ns) > 0
    a = mem.array((MiB,), "int32")
    np.testing.assert_array_equal(cupy.asnumpy(a), np.arange(MiB, dtype=np.int32))
    a += 1  # still writable by a kernel after the exporter is gone
    assert int(a[-1]) == MiB
    del a
    mem.close()
    assert pool.statistics().imported_bytes == 0


def test_a_foreign_fd_is_refused(cupy, pool):
    fd = os.memfd_create("not-cuda")
    os.ftruncate(fd, pool.granularity)
    with ump.ExportHandle(fd, size=pool.granularity, nbytes=pool.granularity,
                          granularity=pool.granularity, device=0, emulated=False) as h:
        with pytest.raises(ump.UmpError):
            pool.import_handle(h)
    assert pool.statistics().views == 0


def _array(cupy, ptr, nbytes, owner, device):
    """A float32 CuPy array over ptr that CuPy treats as living on `device`."""
    mem = cupy.cuda.memory.UnownedMemory(ptr, nbytes, owner, device)
    return cupy.ndarray((nbytes // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))


def test_ring_and_alias_under_kernels(cupy, pool):
    g = pool.granularity
    ring = pool.ring(g)
    r = ring.array((2 * g // 4,), "float32")
    n = g // 4
    r[:n] = cupy.arange(n, dtype=cupy.float32)  # one kernel writes the first half
    cupy.cuda.runtime.deviceSynchronize()
    np.testing.assert_array_equal(cupy.asnumpy(r[n:]), np.arange(n, dtype=np.float32))
    wrap = r[n - 2:n + 2].copy()  # a later kernel reads across the end
    assert cupy.asnumpy(wrap).tolist() == [n - 2, n - 1, 0, 1]

    ptr = pool.allocate(3 * MiB)
    alias = pool.alias(ptr, 3 * MiB)
    src = _array(cupy, ptr, 3 * MiB, pool, 0)
    src.fill(5)  # one kernel writes through the block's address
    cupy.cuda.runtime.deviceSynchronize()
    # a later kernel reads through the alias
    assert float(alias.array((3 * MiB // 4,), "float32").sum()) == 5.0 * 3 * MiB // 4
    del r, wrap, src
    alias.close()
    ring.close()
    pool.deallocate(ptr)


def test_striped_over_two_gpus(cupy, pool, gpu_caps):
    if len(gpu_caps.devices) < 2:
        pytest.skip("needs two GPUs")
    g = pool.granularity
    mem = pool.striped(4 * g, [0, 1])
    assert [mem.device_of(k * g) for k in range(4)] == [0, 1, 0, 1]
    a = mem.array((4 * g // 4,), "float32")
    a.fill(2)
    cupy.cuda.runtime.deviceSynchronize()  # GPU 1 does not wait for GPU 0's stream
    with cupy.cuda.Device(1):  # a kernel on GPU 1 reads every granule, both GPUs' memory
        assert float(_array(cupy, mem.ptr, 4 * g, mem, 1).sum()) == 2.0 * g
    del a
    mem.close()
