"""Benchmark cases. Each runs inside one configuration's process and returns
timings in microseconds: {"cpu": [...], "gpu": [...]} (gpu may be empty).

GPU cases are timed with cupyx.profiler.benchmark (CPU and GPU times of each
repeat); whole-workflow cases, whose steps synchronise on their own, with
perf_counter around each repeat.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

MiB = 1 << 20


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


def workflows(smoke):
    return {
        "single pass 1GiB (fill, 1 kernel, read)": _pass(1, smoke),
        "iterative 1GiB (fill, 10 kernels, read)": _pass(10, smoke),
    }


# --- pools: ump's VMM pool against CuPy's MemoryPool and cudaMallocAsync ----
# These cases build their own pools, so they do not depend on the
# configuration; the runner runs them in the "stock" process only.

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
    from cupy.cuda import runtime

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
        out["fragmentation: cudaMallocAsync pool"] = {
            "cpu": [dt * 1e6], "gpu": [], "metrics": {"peak reserved / peak used": res / peak}}
        runtime.memPoolTrimTo(handle, 0)

        # trim: what the driver gets back of the memory the pool held free
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
        out["trim: returned / free held"] = {
            "cpu": [dt * 1e6], "gpu": [], "metrics": {"returned / free held": back / free_held,
                                                      "free held MiB": free_held / MiB}}
        for b in keep:
            vmm.deallocate(b)
    finally:
        vmm.trim()
        vmm.close()
    return out


# --- the Dask workflow: stock CuPy, CuPy on managed memory and ump, 1 and 2 GPUs ---
# ump.bench.dask_pipeline starts a cluster per configuration and GPU count, so
# the case runs it once, from "stock", in a process of its own: Dask and its
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
        if r["workers"] != fewest and r["config"] in first:
            metrics[f"speed-up vs {fewest} GPU"] = first[r["config"]] / r["median_s"]
        gpus = f"{r['workers']} GPU{'s' * (r['workers'] > 1)}"
        out[f"dask {size}, {gpus}: {r['label']}"] = {
            "cpu": [s * 1e6 for s in r["seconds"]], "gpu": [], "metrics": metrics}
    return out


def dask_workflow(smoke):
    args = ["--size", "512MiB", "--chunk", "32MiB", "--repeat", "1"] if smoke else []
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
              "workflows": workflows, "pools": pools, "dask": dask_workflow}
#: Suites whose cases do not depend on the configuration: run once, in "stock".
CONFIG_FREE = {"pools", "dask"}
#: Suites that need a package beyond CuPy: suite -> (module, how to install it).
NEEDS = {"dask": ("distributed", "pip install ump[dask]")}
