"""Benchmark cases. Each runs inside one configuration's process and returns
timings in microseconds: {"cpu": [...], "gpu": [...]} (gpu may be empty).

GPU cases are timed with cupyx.profiler.benchmark (CPU and GPU times of each
repeat); whole-workflow cases, whose steps synchronise on their own, with
perf_counter around each repeat.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


MiB = 1 << 20
GiB = 1 << 30


def _wall(fn, repeat, setup=None):
    times = []
    for _ in range(repeat):
        state = setup() if setup else None
        t0 = time.perf_counter()
        fn(state)
        times.append((time.perf_counter() - t0) * 1e6)
    return {"cpu": times, "gpu": []}


def _per_call(fn, calls, repeat):
    """Mean time of one call, over `calls` calls, `repeat` times."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return {"cpu": times, "gpu": []}


def _cupyx(fn, args, repeat):
    from cupyx.profiler import benchmark

    r = benchmark(fn, args, n_repeat=repeat, n_warmup=3)
    return {"cpu": list(r.cpu_times * 1e6), "gpu": list(r.gpu_times[0] * 1e6)}


# --- CPU-side allocation (runs without a GPU too) ---------------------------

def alloc_numpy(smoke):
    calls, repeat = (200, 5) if smoke else (20000, 15)
    out = {}
    for label, n in (("64B", 8), ("1MiB", MiB // 8)):
        np.empty(n)
        out[f"np.empty {label}"] = _per_call(lambda n=n: np.empty(n), calls, repeat)
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1 << 18, size=256)

    def churn():
        keep = [np.empty(int(s), dtype=np.uint8) for s in sizes]
        del keep[::2]
        keep += [np.empty(int(s) // 2 + 1, dtype=np.uint8) for s in sizes[:64]]

    out["alloc/free churn (256 arrays)"] = _per_call(churn, 3 if smoke else 50, repeat)
    return out


# --- GPU cases -----------------------------------------------------------

def alloc_cupy(smoke):
    import cupy

    repeat = 20 if smoke else 2000
    return {
        "cupy.empty 1MiB": _cupyx(lambda: cupy.empty(MiB, dtype=np.uint8), (), repeat),
        "cupy.empty 64MiB": _cupyx(lambda: cupy.empty(64 * MiB, dtype=np.uint8), (), repeat),
    }


def dispatch(smoke):
    import cupy

    out = {}
    repeat = 20 if smoke else 2000
    for n in (100, 200, 500, 1000):
        x = cupy.ones((n, n), dtype=np.float32)
        y = cupy.full((n, n), 3, dtype=np.float32)
        for name, fn in (("add", cupy.add), ("divide", cupy.divide), ("divmod", cupy.divmod)):
            out[f"{name} {n}x{n}"] = _cupyx(fn, (x, y), repeat)
    return out


def interop(smoke):
    import cupy

    sizes = [MiB] if smoke else [MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
    out = {}
    for size in sizes:
        label = f"{size // MiB}MiB"
        repeat = 3 if smoke else (10 if size >= 256 * MiB else 50)
        a = np.ones(size // 4, dtype=np.float32)
        g = cupy.asarray(a)
        out[f"asarray {label}"] = _cupyx(cupy.asarray, (a,), repeat)
        out[f"asnumpy {label}"] = _cupyx(cupy.asnumpy, (g,), repeat)
        out[f"roundtrip {label}"] = _cupyx(lambda a=a: cupy.asnumpy(cupy.asarray(a)), (), repeat)
        del a, g
    return out


def _pass(kernels, smoke):
    import cupy

    n = (16 * MiB if smoke else 1024 * MiB) // 4

    def setup():
        a = np.empty(n, dtype=np.float32)  # a fresh array: nothing known about it
        a[:] = 1.0
        cupy.cuda.runtime.deviceSynchronize()
        return a

    def run(a):
        g = cupy.asarray(a)
        for _ in range(kernels):
            g *= 2
        b = cupy.asnumpy(g)
        assert b[::1024].sum() == (2.0 ** kernels) * (n // 1024)  # host reads every page

    return _wall(run, 3 if smoke else 7, setup)


def _resident(smoke):
    """Handed to CuPy once, then a loop of GPU work whose result the host
    looks at a little of each step: the data should stay where the kernels are."""
    import cupy

    n, steps = ((16 * MiB, 3) if smoke else (256 * MiB, 20))
    n //= 4

    def setup():
        a = np.ones(n, dtype=np.float32)
        cupy.cuda.runtime.deviceSynchronize()
        return a

    def run(a):
        g = cupy.asarray(a)
        for step in range(steps):
            g += 1
            g *= 1  # a second kernel over all of it
            b = cupy.asnumpy(g)
            assert b[:1024].sum() == 1024 * (step + 2)  # the host reads 4 KiB

    return _wall(run, 3 if smoke else 7, setup)


def _cupy_made(smoke):
    """An array CuPy makes, brought to the host and read whole by NumPy."""
    import cupy

    n = (16 * MiB if smoke else 1024 * MiB) // 4

    def run(_):
        g = cupy.random.random(n, dtype=cupy.float32)
        b = cupy.asnumpy(g)
        mean = float(b.sum(dtype=np.float64)) / n
        assert 0.49 < mean < 0.51

    return _wall(run, 3 if smoke else 7)


def _many(smoke):
    """Many mid-sized arrays, each NumPy -> one kernel -> NumPy."""
    import cupy

    count, n = (8 if smoke else 64), 8 * MiB // 4

    def setup():
        arrays = [np.full(n, float(i), dtype=np.float32) for i in range(count)]
        cupy.cuda.runtime.deviceSynchronize()
        return arrays

    def run(arrays):
        for i, a in enumerate(arrays):
            g = cupy.asarray(a)
            g *= 2
            b = cupy.asnumpy(g)
            assert b[::1024].sum() == 2.0 * i * (n // 1024)  # the host reads every page

    return _wall(run, 3 if smoke else 7, setup)


def _numpy_only(smoke):
    """NumPy alone, no GPU work, in a process where ump is enabled: a sort,
    ufuncs over large arrays, and many small arrays."""
    n, small = (1 << 16, 1000) if smoke else (1 << 23, 100_000)

    def run(_):
        x = np.random.default_rng(0).random(n)
        y = np.sort(x)
        z = np.sqrt(y) * 2.0 + np.sin(y)
        parts = [np.arange(64, dtype=np.float64) * k for k in range(small)]
        total = float(z.sum()) + sum(float(p[-1]) for p in parts)
        assert total > 0

    return _wall(run, 3 if smoke else 7)


def workflows(smoke):
    return {
        "single pass 1GiB (fill, 1 kernel, read)": _pass(1, smoke),
        "iterative 1GiB (fill, 10 kernels, read)": _pass(10, smoke),
        "resident 256MiB (hand-off once, 20 x (2 kernels, asnumpy, read 4KiB))": _resident(smoke),
        "CuPy-made 1GiB (cupy.random, asnumpy, NumPy sums all)": _cupy_made(smoke),
        "64 x 8MiB (NumPy, 1 kernel, NumPy reads)": _many(smoke),
        "NumPy only (sort, ufuncs, 100k small arrays)": _numpy_only(smoke),
    }


# --- moves: managed memory between the host and the GPU, each way ------------
# The figures the placement rules stand on (docs/backends.md), per GiB. Every
# repeat takes a fresh managed buffer and puts it where the move starts,
# untimed: filled by the host for a move to the GPU, then written by a kernel
# for a move back. Discarding managed pages needs CUDA 13 and a stream other
# than the legacy default one.

MOVES_CASES = ("managed 1GiB to the GPU: prefetch",
               "managed 1GiB to the host: prefetch",
               "managed 1GiB, GPU-resident, into pinned memory: DMA (no move)",
               "managed 1GiB there and back: prefetch, 10 kernels, prefetch (the iterative workflow without ump)",
               "managed 1GiB to the host: host pages alone (discard, prefetch to the host)",
               "managed 1GiB to the host: DMA into pinned memory, discard, prefetch, 8-thread copy",
               "managed 1GiB to the host: DMA into pinned memory, discard, 8-thread copy (host faults)")


def _threaded_copy(dst, src, threads=8):
    import threading

    bounds = np.linspace(0, dst.shape[0], threads + 1).astype(np.int64)
    workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b]))
               for a, b in zip(bounds[:-1], bounds[1:])]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


class _Moves:
    """Fresh managed buffers of ``size`` bytes on GPU 0, and the moves."""

    def __init__(self, cupy, size):
        from .. import _core

        self.cupy, self.rt, self.core, self.size, self.n = cupy, cupy.cuda.runtime, _core, size, size // 4
        _core.cuda_load()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.staging = cupy.cuda.alloc_pinned_memory(size)
        self.pinned = np.frombuffer(self.staging, np.float32, self.n)

    def fresh(self, gpu_written):
        """(pointer, host view, GPU view): 1.0 filled by the host, then 2.0
        written by a kernel where ``gpu_written``."""
        import ctypes

        p = self.rt.mallocManaged(self.size, 1)  # cudaMemAttachGlobal
        host = np.ctypeslib.as_array((ctypes.c_float * self.n).from_address(p))
        gpu = self.gpu_view(p)
        host[:] = 1.0
        if gpu_written:
            self.core.prefetch(p, self.size, 0, self.stream.ptr)
            with self.stream:
                gpu += 1.0
        self.stream.synchronize()
        return p, host, gpu

    def gpu_view(self, p):
        cupy = self.cupy
        return cupy.ndarray((self.n,), cupy.float32,
                            cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(p, self.size, None), 0))

    def discard(self, p, prefetch_to_host):
        """Drop the managed pages' contents (cuMemDiscardBatchAsync), and
        make host pages for them where ``prefetch_to_host``."""
        from cuda.bindings import driver

        name = "cuMemDiscardAndPrefetchBatchAsync" if prefetch_to_host else "cuMemDiscardBatchAsync"
        call = getattr(driver, name, None)
        if call is None:
            raise NotImplementedError(f"cuda-bindings has no {name} (CUDA 13)")
        ranges = ([driver.CUdeviceptr(p)], [self.size], 1)
        if prefetch_to_host:
            host = driver.CUmemLocation()
            host.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
            err, = call(*ranges, [host], [0], 1, 0, driver.CUstream(self.stream.ptr))
        else:
            err, = call(*ranges, 0, driver.CUstream(self.stream.ptr))
        if err in (driver.CUresult.CUDA_ERROR_NOT_FOUND, driver.CUresult.CUDA_ERROR_NOT_SUPPORTED):
            raise NotImplementedError(f"{name}: {err.name} (needs a CUDA 13 driver)")
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} of {self.size} bytes at {p:#x}: {err.name}")

    def timed(self, gpu_written, move, check, repeat):
        times = []
        for _ in range(repeat):
            p, host, gpu = self.fresh(gpu_written)
            try:
                t0 = time.perf_counter()
                move(p, host)
                self.stream.synchronize()
                times.append((time.perf_counter() - t0) * 1e6)
                check(host, gpu)
            finally:
                del gpu
                self.rt.free(p)
        return {"cpu": times, "gpu": [],
                "metrics": {"ms per GiB": statistics.median(times) / 1e3 * GiB / self.size}}


def moves(smoke):
    import cupy

    from .._probe import probe

    rt = cupy.cuda.runtime
    size = 64 * MiB if smoke else GiB
    why = None
    if not probe().devices[0].concurrent_managed_access:
        why = "GPU 0 has no concurrent managed access: managed memory does not move by prefetch"
    elif 2 * size > _spare(cupy, 0):
        why = "too little free memory on GPU 0"
    if why:
        return {case: {"skipped": why} for case in MOVES_CASES}
    m, repeat = _Moves(cupy, size), 2 if smoke else 5
    every_page = slice(None, None, 1024)  # one float32 in each 4 KiB page

    def reads(view, value):
        def check(host, gpu):
            got = view(host, gpu)[every_page]
            if not bool((got == value).all()):
                raise AssertionError(f"a page read {float(got.min())}..{float(got.max())}, not {value}")
        return check

    def dma(p, host):
        rt.memcpyAsync(m.staging.ptr, p, m.size, rt.memcpyDefault, m.stream.ptr)

    def back_by_copy(prefetch_to_host):
        def move(p, host):
            dma(p, host)
            m.discard(p, prefetch_to_host)
            m.stream.synchronize()
            _threaded_copy(host, m.pinned)
        return move

    def cycle(p, host):  # the floor under the iterative workflow on this machine
        m.core.prefetch(p, m.size, 0, m.stream.ptr)
        gpu = m.gpu_view(p)
        with m.stream:
            for _ in range(10):
                gpu *= 2
        m.core.prefetch(p, m.size, -1, m.stream.ptr)

    def host_pages(p, host):
        m.discard(p, prefetch_to_host=True)

    def written_after(host, gpu):  # the contents are gone: the pages take the host's writes
        host[every_page] = 3.0
        reads(lambda h, g: h, 3.0)(host, gpu)

    try:
        out = {
            MOVES_CASES[0]: m.timed(False, lambda p, h: m.core.prefetch(p, m.size, 0, m.stream.ptr),
                                   reads(lambda h, g: g, 1.0), repeat),
            MOVES_CASES[1]: m.timed(True, lambda p, h: m.core.prefetch(p, m.size, -1, m.stream.ptr),
                                   reads(lambda h, g: h, 2.0), repeat),
            MOVES_CASES[2]: m.timed(True, dma, reads(lambda h, g: m.pinned, 2.0), repeat),
            MOVES_CASES[3]: m.timed(False, cycle, reads(lambda h, g: h, 1024.0), repeat),
        }
        try:
            out[MOVES_CASES[4]] = m.timed(True, host_pages, written_after, repeat)
            out[MOVES_CASES[5]] = m.timed(True, back_by_copy(True), reads(lambda h, g: h, 2.0), repeat)
            out[MOVES_CASES[6]] = m.timed(True, back_by_copy(False), reads(lambda h, g: h, 2.0), repeat)
        except NotImplementedError as e:
            out.update({case: {"skipped": str(e)} for case in MOVES_CASES[4:]})
    finally:
        del m.pinned, m.staging
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    return out


# --- pools: ump's VMM pool against CuPy's MemoryPool and cudaMallocAsync ----
# These cases build their own pools, so they do not depend on the
# configuration; the runner runs them in the "imported" process only.

def _growth(pool, step, count, repeat, keep_handles):
    """Microseconds per 2 MiB to map `count` blocks of `step` bytes, with the
    pool's handles cached (keep_handles) or released (fresh cuMemCreate)."""
    import cupy

    times = []
    for _ in range(repeat + 1):
        cupy.cuda.runtime.deviceSynchronize()
        pool.trim(keep_handles=keep_handles)
        t0 = time.perf_counter()
        blocks = [pool.allocate(step) for _ in range(count)]
        dt = time.perf_counter() - t0
        for b in blocks:
            pool.deallocate(b)
        times.append(dt * 1e6 / (count * step / (2 * MiB)))
    return {"cpu": times[1:], "gpu": []}  # the first fills the cache


def _frag_ops(smoke, seed=0):
    import random

    rng = random.Random(seed)
    steps, budget, top = (300, 64 * MiB, 22) if smoke else (4000, 2 << 30, 26)
    ops, live, used = [], [], 0
    for i in range(steps):
        if live and (rng.random() < 0.45 or used > budget):
            key, n = live.pop(rng.randrange(len(live)))
            used -= n
            ops.append((key, 0))
        else:
            n = (int(2 ** rng.uniform(10, top)) + 511) // 512 * 512
            live.append((i, n))
            used += n
            ops.append((i, n))
    return ops


def _replay(ops, malloc, reserved):
    """Run the workload; returns (seconds, peak bytes in use, peak reserved)."""
    live, used, peak_used, peak_res = {}, 0, 0, 0
    t0 = time.perf_counter()
    for key, n in ops:
        if n:
            live[key] = (malloc(n), n)
            used += n
            peak_used = max(peak_used, used)
            if reserved is not None:
                peak_res = max(peak_res, reserved())
        else:
            used -= live.pop(key)[1]
    dt = time.perf_counter() - t0
    live.clear()
    return dt, peak_used, peak_res


def pools(smoke):
    import cupy

    from .._vmm import VMMPool

    out = {}
    repeat = 3 if smoke else 10
    count = 8 if smoke else 128
    vmm = VMMPool(0)
    try:
        for step, label in ((2 * MiB, "2MiB"), (64 * MiB, "64MiB")):
            n = count if step == 2 * MiB else max(count // 16, 2)
            out[f"VMM growth per 2MiB, {label} steps, handles reused"] = _growth(vmm, step, n, repeat, True)
            out[f"VMM growth per 2MiB, {label} steps, new handles"] = _growth(vmm, step, n, repeat, False)
        mp = cupy.cuda.MemoryPool()

        def cupy_growth():
            times = []
            for _ in range(repeat):
                mp.free_all_blocks()
                t0 = time.perf_counter()
                blocks = [mp.malloc(2 * MiB) for _ in range(count)]
                times.append((time.perf_counter() - t0) * 1e6 / count)
                del blocks
            return {"cpu": times, "gpu": []}

        out["CuPy MemoryPool growth per 2MiB (cudaMalloc)"] = cupy_growth()
        mp.free_all_blocks()

        ops = _frag_ops(smoke)
        vmm.trim()
        base = vmm.statistics()
        dt, peak, _ = _replay(ops, vmm.malloc, None)
        st = vmm.statistics()
        assert st.peak_used_bytes - base.used_bytes >= peak
        out["fragmentation: ump VMMPool"] = {
            "cpu": [dt * 1e6], "gpu": [],
            "metrics": {"peak reserved / peak used": st.peak_physical_bytes / peak}}

        mp = cupy.cuda.MemoryPool()
        dt, peak, res = _replay(ops, mp.malloc, mp.total_bytes)
        out["fragmentation: CuPy MemoryPool"] = {
            "cpu": [dt * 1e6], "gpu": [], "metrics": {"peak reserved / peak used": res / peak}}
        mp.free_all_blocks()

        out["fragmentation: cudaMallocAsync pool"] = _async_pool_fragmentation(cupy, ops)
        out["trim: returned / free held"] = _trim_returns(vmm, smoke)
    finally:
        vmm.trim()
        vmm.close()
    return out


def _async_pool_fragmentation(cupy, ops):
    """The fragmentation workload on CUDA's stream-ordered pool (cudaMallocAsync)."""
    runtime = cupy.cuda.runtime
    dev = cupy.cuda.Device().id
    handle = runtime.deviceGetMemPool(dev)
    runtime.deviceSynchronize()
    runtime.memPoolTrimTo(handle, 0)
    for attr in (0x6, 0x8):  # cudaMemPoolAttrReservedMemHigh, cudaMemPoolAttrUsedMemHigh
        runtime.memPoolSetAttribute(handle, attr, 0)
    ap = cupy.cuda.MemoryAsyncPool()
    dt, peak, _ = _replay(ops, ap.malloc, None)
    runtime.deviceSynchronize()
    res = runtime.memPoolGetAttribute(handle, 0x6)
    runtime.memPoolTrimTo(handle, 0)
    return {"cpu": [dt * 1e6], "gpu": [], "metrics": {"peak reserved / peak used": res / peak}}


def _trim_returns(vmm, smoke):
    """Trim: what the driver gets back of the memory the pool held free."""
    from cupy.cuda import runtime

    keep = [vmm.allocate(n) for n in (5 * MiB, 300 * 1024)]
    blocks = [vmm.allocate((i % 7 + 1) * 3 * MiB) for i in range(8 if smoke else 200)]
    for b in blocks:
        vmm.deallocate(b)
    runtime.deviceSynchronize()
    st = vmm.statistics()
    free_held = st.physical_bytes - st.used_bytes
    before = runtime.memGetInfo()[0]
    t0 = time.perf_counter()
    vmm.trim()
    dt = time.perf_counter() - t0
    back = runtime.memGetInfo()[0] - before
    for b in keep:
        vmm.deallocate(b)
    return {"cpu": [dt * 1e6], "gpu": [], "metrics": {"returned / free held": back / free_held,
                                                      "free held MiB": free_held / MiB}}


# --- vmm: memory shared the ways the VMM API allows ----------------------------
# Between processes (export, import, map), at two addresses (a ring read
# across its wrap), over two GPUs (striped). Configuration-free, as pools.
# A case that cannot run here is returned as {"skipped": reason}.


def _spare(cupy, device) -> int:
    """Bytes a case may take on `device`: its free memory less a headroom
    (the importing process's CUDA context, CuPy's own arrays)."""
    with cupy.cuda.Device(device):
        free, total = cupy.cuda.runtime.memGetInfo()
    return free - max(2 * GiB, total // 10)


def _answer(results, proc, timeout):
    if not results.poll(timeout):
        raise RuntimeError(f"the importing process did not answer within {timeout} s")
    try:
        return results.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"the importing process exited (status {proc.exitcode})") from None


def _share_importer(address, results):
    """The second process of the share case: imports each handle it is sent
    (through ump.share's socket), checks the marks the exporter wrote at both
    ends, and sends back how long each step took."""
    import ump.share

    with ump.share.connect(address) as conn:
        results.send("ready")
        count = 0
        while True:
            try:
                handle = conn.recv()
            except EOFError:  # the exporter is done
                return
            mark = count % 255 + 1
            count += 1
            t0 = time.perf_counter()
            mem = ump.import_handle(handle)
            call = time.perf_counter() - t0
            handle.close()
            a = mem.array((handle.size,), "uint8")
            ok = int(a[0]) == mark and int(a[-1]) == mark
            del a
            mem.close()
            results.send({"call": call, "ok": ok, **dataclasses.asdict(mem.setup_times)})


def _share(pool, sizes, repeat, timeout=120):
    """Export `repeat` new allocations of each size from `pool` to a second,
    spawned process that imports them: microseconds per GiB of the export,
    the import of the handle, reserve + map + set access (the importer's
    ViewTimes), and the whole ump.import_handle() call. Runs on an emulated
    pool too (memfds), where the same steps are OS calls."""
    import multiprocessing

    import ump.share

    ctx = multiprocessing.get_context("spawn")
    results, there = ctx.Pipe()
    out, count = {}, 0
    # One pass before the timed ones: the importer's first import also
    # creates its CUDA context and its pool.
    passes = [(sizes[0], 1, False)] + [(size, repeat, True) for size in sizes]
    with ump.share.listen() as listener:
        proc = ctx.Process(target=_share_importer, args=(listener.address, there), daemon=True)
        proc.start()
        there.close()
        try:
            if _answer(results, proc, timeout) != "ready":
                raise RuntimeError("the importing process did not connect")
            with listener.accept() as conn:
                for size, n, timed in passes:
                    steps = {"export": [], "physical_ns": [], "view_ns": [], "reserve_ns": [],
                             "map_ns": [], "access_ns": [], "call": []}
                    for _ in range(n):
                        mark = count % 255 + 1
                        count += 1
                        with pool.allocate_shared(size) as mem:
                            a = mem.array((size,), "uint8")
                            a[0] = mark
                            a[-1] = mark
                            del a
                            if not pool.emulated:  # no event exported: the marks are written first
                                import cupy

                                cupy.cuda.runtime.deviceSynchronize()
                            t0 = time.perf_counter()
                            handle = mem.export()
                            steps["export"].append((time.perf_counter() - t0) * 1e9)
                            with handle:
                                conn.send(handle)
                            r = _answer(results, proc, timeout)
                        if not r["ok"]:
                            raise RuntimeError(f"the importing process did not read the marks written "
                                               f"at both ends of {size} bytes")
                        r["view_ns"] = r["reserve_ns"] + r["map_ns"] + r["access_ns"]
                        steps["call"].append(r["call"] * 1e9)
                        for key in ("physical_ns", "view_ns", "reserve_ns", "map_ns", "access_ns"):
                            steps[key].append(r[key])
                    if not timed:
                        continue
                    per_gib = {k: [ns / 1e3 * GiB / size for ns in v] for k, v in steps.items()}
                    label = f"VMM share {size // MiB}MiB, µs per GiB"
                    out[f"{label}: export"] = {"cpu": per_gib["export"], "gpu": []}
                    out[f"{label}: import"] = {"cpu": per_gib["physical_ns"], "gpu": []}
                    out[f"{label}: reserve + map + set access"] = {
                        "cpu": per_gib["view_ns"], "gpu": [],
                        "metrics": {name: statistics.median(per_gib[key]) for name, key in
                                    (("reserve", "reserve_ns"), ("map", "map_ns"),
                                     ("set access", "access_ns"))}}
                    out[f"{label}: ump.import_handle() in all"] = {"cpu": per_gib["call"], "gpu": []}
        finally:
            results.close()
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return out


_READ_ALL = r"""
extern "C" __global__ void read_all(const float4 *__restrict__ x, unsigned long long n, float *out)
{
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    float acc = 0.0f;
    for (; i < n; i += stride) {
        float4 v = x[i];
        acc += (v.x + v.y) + (v.z + v.w);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""


class _Reader:
    """A kernel on one device that reads a float32 array once, 16 bytes per
    load, and leaves one partial sum per thread: the reads cannot be
    optimised away, and their total says what was read."""

    threads = 256

    def __init__(self, cupy, device):
        self.cupy, self.device = cupy, device
        with cupy.cuda.Device(device) as dev:
            self.blocks = 8 * dev.attributes["MultiProcessorCount"]
            self.kernel = cupy.RawKernel(_READ_ALL, "read_all")
            self.out = cupy.empty(self.blocks * self.threads, cupy.float32)

    def run(self, x):
        with self.cupy.cuda.Device(self.device):
            self.kernel((self.blocks,), (self.threads,), (x, np.uint64(x.size // 4), self.out))

    def check(self, x, expected: float, what: str) -> None:
        self.run(x)
        with self.cupy.cuda.Device(self.device):
            total = float(self.out.sum(dtype=self.cupy.float64))
        if total != expected:
            raise RuntimeError(f"a kernel on GPU {self.device} reading {what} summed {total}, not {expected}")


def _gbps(nbytes, times_us) -> float:
    return nbytes / statistics.median(times_us) / 1e3


def _ring(cupy, pool, size, repeat):
    """A kernel reading `size` bytes of a ring from its middle, across the
    wrap, against the same kernel on a block of the pool of the same size."""
    n = size // 4
    read = _Reader(cupy, pool.device)
    with pool.ring(size) as ring:
        r = ring.array((2 * n,), "float32")
        r[:n].fill(1)  # through the first mapping; read below through both
        across = r[n // 2:n // 2 + n]
        with cupy.cuda.using_allocator(pool.malloc):
            plain = cupy.ones(n, cupy.float32)
        read.check(across, n, "a ring across its wrap")
        read.check(plain, n, "plain pool memory")
        wrap, flat = _cupyx(read.run, (across,), repeat), _cupyx(read.run, (plain,), repeat)
        del r, across, plain
    label = f"VMM ring {size // MiB}MiB"
    ratio = statistics.median(wrap["gpu"]) / statistics.median(flat["gpu"])
    return {
        f"{label}: a kernel reading it across the wrap": {
            **wrap, "metrics": {"GB/s": _gbps(size, wrap["gpu"]), "ratio to plain pool memory": ratio}},
        f"{label}: the same kernel on plain pool memory": {
            **flat, "metrics": {"GB/s": _gbps(size, flat["gpu"])}},
    }


STRIPED_CASES = ("VMM striped over GPUs 0 and 1: both GPUs reading all of it at once",
                 "VMM striped over GPUs 0 and 1: GPU 0 reading all of it",
                 "VMM on GPU 1 alone: GPU 0 reading all of it over the peer link")


def _striped_why_not(ndevices: int, can_access_peer) -> str | None:
    """Why the striped cases cannot run here, or None. `can_access_peer(a, b)`
    is cudaDeviceCanAccessPeer."""
    if ndevices < 2:
        return f"needs two GPUs, this machine has {ndevices}"
    if not (can_access_peer(0, 1) and can_access_peer(1, 0)):
        return "GPUs 0 and 1 cannot access each other's memory (cudaDeviceCanAccessPeer is 0)"
    return None


def _on_device(cupy, mem, device):
    """A float32 array over all of `mem` that CuPy places on `device`, so a
    kernel launched there may take it (mem.array() places it on the pool's)."""
    um = cupy.cuda.memory.UnownedMemory(mem.ptr, mem.size, mem, device)
    return cupy.ndarray((mem.size // 4,), cupy.float32, cupy.cuda.MemoryPointer(um, 0))


def _striped(cupy, pool, smoke):
    """GB/s of kernels reading memory striped over GPUs 0 and 1: on both GPUs
    at once, on GPU 0 alone; and GPU 0 reading memory wholly on GPU 1."""
    from cupyx.profiler import benchmark

    runtime = cupy.cuda.runtime
    why = _striped_why_not(runtime.getDeviceCount(), runtime.deviceCanAccessPeer)
    if why is None:
        step = 2 * pool.granularity  # as many granules on each GPU
        size = min(256 * MiB if smoke else 8 * GiB, _spare(cupy, 0), _spare(cupy, 1)) // step * step
        if size <= 0:
            why = "too little free memory on GPU 0 or 1"
    if why is not None:
        return {case: {"skipped": why} for case in STRIPED_CASES}
    repeat = 3 if smoke else 10
    n = size // 4
    readers = [_Reader(cupy, 0), _Reader(cupy, 1)]
    both, alone, peer = STRIPED_CASES
    out = {}
    with pool.striped(size, [1]) as remote:  # every granule on GPU 1, mapped as the striped ones
        x = remote.array((n,), "float32")
        x.fill(1)
        readers[0].check(x, n, "GPU 1's memory")
        t = _cupyx(readers[0].run, (x,), repeat)
        out[peer] = {**t, "metrics": {"GB/s": _gbps(size, t["gpu"]), "GiB": size / GiB}}
        del x
    with pool.striped(size, [0, 1]) as mem:
        x0, x1 = mem.array((n,), "float32"), _on_device(cupy, mem, 1)
        x0.fill(1)
        readers[0].check(x0, n, "striped memory")
        readers[1].check(x1, n, "striped memory")
        t = _cupyx(readers[0].run, (x0,), repeat)
        out[alone] = {**t, "metrics": {"GB/s": _gbps(size, t["gpu"]), "GiB": size / GiB}}

        def read_on_both(x0, x1):
            readers[0].run(x0)
            readers[1].run(x1)

        r = benchmark(read_on_both, (x0, x1), n_repeat=repeat, n_warmup=3, devices=(0, 1))
        per_gpu = r.gpu_times * 1e6
        span = list(per_gpu.max(axis=0))  # both started together: the later end
        out[both] = {"cpu": list(r.cpu_times * 1e6), "gpu": span, "metrics": {
            "GB/s, both GPUs": _gbps(2 * size, span), "GB/s, GPU 0": _gbps(size, per_gpu[0]),
            "GB/s, GPU 1": _gbps(size, per_gpu[1]), "GiB": size / GiB}}
        del x0, x1
    return {case: out[case] for case in STRIPED_CASES}


def vmm(smoke):
    import cupy

    from .._vmm import VMMPool

    cupy.get_default_memory_pool().free_all_blocks()
    spare = _spare(cupy, 0)
    out = {}
    pool = VMMPool(0)
    try:
        sizes = [s for s in ((16 * MiB,) if smoke else (256 * MiB, GiB, 4 * GiB)) if s <= spare]
        if sizes:
            out.update(_share(pool, sizes, 2 if smoke else 10))
        else:
            out["VMM share"] = {"skipped": "too little free memory on GPU 0"}
        size = next((s for s in ((64 * MiB,) if smoke else (GiB, 256 * MiB)) if 2 * s <= spare), None)
        if size:
            out.update(_ring(cupy, pool, size, 5 if smoke else 50))
        else:
            out["VMM ring"] = {"skipped": "too little free memory on GPU 0"}
        out.update(_striped(cupy, pool, smoke))
    finally:
        pool.trim()
        pool.close()
    return out


# --- the Dask workflow: stock CuPy, CuPy on managed memory and ump, 1 and 2 GPUs ---
# ump.bench.dask_pipeline starts a cluster per configuration and GPU count, so
# the case runs it once, from "imported", in a process of its own: Dask and its
# workers stay out of the process that times the other suites.

def dask_cases(report: dict) -> dict:
    """Cases from a report of ``python -m ump.bench.dask_pipeline --json``:
    one per configuration and GPU count, timed in microseconds per run."""
    size = f"{report['nbytes'] / 2**30:.3g}GiB"
    runs = report["runs"]
    stock = {r["workers"]: r["median_s"] for r in runs if r["config"] == "stock"}
    fewest = min(r["workers"] for r in runs)
    first = {r["config"]: r["median_s"] for r in runs if r["workers"] == fewest}
    out = {}
    for r in runs:
        metrics = {"GiB/s": report["nbytes"] / 2**30 / r["median_s"]}
        if r["config"] != "stock" and r["workers"] in stock:
            metrics["speed-up vs stock"] = stock[r["workers"]] / r["median_s"]
        unit = "GPU" if r.get("gpu", True) else "worker"  # --cpu: NumPy in place of CuPy
        if r["workers"] != fewest and r["config"] in first:
            metrics[f"speed-up vs {fewest} {unit}"] = first[r["config"]] / r["median_s"]
        count = f"{r['workers']} {unit}{'s' * (r['workers'] > 1)}"
        out[f"dask {size}, {count}: {r['label']}"] = {
            "cpu": [s * 1e6 for s in r["seconds"]], "gpu": [], "metrics": metrics}
    return out


def dask_workflow(smoke):
    import importlib.util

    args = ["--size", "512MiB", "--chunk", "32MiB", "--repeat", "1"] if smoke else []
    if importlib.util.find_spec("rmm") is None:  # the managed anchor, RMM's pool, is not installed
        args += ["--configs", "stock,cupy-managed,ump"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dask.json")
        proc = subprocess.run([sys.executable, "-m", "ump.bench.dask_pipeline", *args, "--json", path],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the Dask workflow failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return dask_cases(json.load(f))


CPU_SUITES = {"alloc_numpy": alloc_numpy}
GPU_SUITES = {"alloc_cupy": alloc_cupy, "dispatch": dispatch, "interop": interop,
              "workflows": workflows, "moves": moves, "pools": pools, "vmm": vmm, "dask": dask_workflow}
#: Suites whose cases do not depend on the configuration: run once, in "imported"
#: (they measure ump's own pools and moves).
CONFIG_FREE = {"moves", "pools", "vmm", "dask"}
#: Suites a run of every suite leaves out, and why.
ON_REQUEST = {"dask": "a 16 GiB workflow on 1 and 2 GPUs, several minutes"}
