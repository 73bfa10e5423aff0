"""Benchmark cases. Each runs inside one configuration's process and returns
timings in microseconds: {"cpu": [...], "gpu": [...]} (gpu may be empty).

GPU cases are timed with cupyx.profiler.benchmark (CPU and GPU times of each
repeat); whole-workflow cases, whose steps synchronise on their own, with
perf_counter around each repeat.
"""

from __future__ import annotations

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


CPU_SUITES = {"alloc_numpy": alloc_numpy}
GPU_SUITES = {"alloc_cupy": alloc_cupy, "dispatch": dispatch, "interop": interop,
              "workflows": workflows}
