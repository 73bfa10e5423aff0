"""Time a solver's step on tiny arrays in several processes that share one
GPU, under stock CuPy, stock CuPy over ``cudaMallocManaged`` and ump's
backends: what a test suite run with ``pytest -n 4`` does in each worker
(PyLops's ISTA, LSQR), with nothing else in the way.

    python tools/shared_step.py --processes 1,4 --reads 2,3 \\
        --configs stock,managed-pool,auto,device

The step (``A`` 31 × 11): ``r = y - A @ x``, ``x += 0.01 * A.T @ r``, two
norms, then its reads: with ``--reads 2`` the two scalars a solver tests
(``bool(norm(dx) >= 0)``, ``float(cost)``), with 3 also a small result
copied back (``r[:4].get()``). Each process runs four trials of 800 steps
and reports µs per step of the last three (the first compiles and warms
the pools); the table gives per configuration the median over its
processes and over rounds, and that against stock's. Configurations:
``stock`` (``CUPY_ENABLE_UMP`` unset, ump never imported),
``managed-pool`` (as stock, CuPy's pool over ``cupy.cuda.malloc_managed``:
what managed memory costs without ump), and a backend of ump (``auto``,
``managed``, ``pinned``, ``device``: ``python -m ump run``). The processes
of one run start together; configurations alternate round by round.
Nothing here asserts: docs/performance.md (run 28) reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TRIALS, STEPS = 4, 800
MANAGED_POOL = "UMP_TOOL_MANAGED_POOL"


def _step_loop(reads: int) -> list[float]:
    """µs per step of each trial, in this process."""
    import cupy

    if os.environ.get(MANAGED_POOL) == "1":
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
    cupy.random.seed(0)
    a = cupy.random.randn(31, 11)
    y = a @ cupy.ones(11)
    sync = cupy.cuda.runtime.deviceSynchronize
    per_step = []
    for _ in range(TRIALS):
        x = cupy.zeros(11)
        sync()
        start = time.perf_counter()
        for _ in range(STEPS):
            r = y - a @ x
            previous = x
            x = x + 0.01 * (a.T @ r)
            moving = bool(cupy.linalg.norm(x - previous) >= 0)
            float(0.5 * cupy.linalg.norm(r) ** 2)
            if reads > 2:
                r[:4].get()
            if not moving:
                raise SystemExit("the step did not run")
        per_step.append((time.perf_counter() - start) / STEPS * 1e6)
    return per_step


def command(config: str, reads: int) -> tuple[list[str], dict]:
    """One worker's command line and environment."""
    env = dict(os.environ)
    env.pop(MANAGED_POOL, None)
    worker = [__file__, "--worker", str(reads)]
    if config in ("stock", "managed-pool"):
        env.pop("CUPY_ENABLE_UMP", None)
        if config == "managed-pool":
            env[MANAGED_POOL] = "1"
        return [sys.executable, *worker], env
    backend = [] if config == "auto" else ["--backend", config]
    return [sys.executable, "-m", "ump", "run", *backend, *worker], env


def run(config: str, reads: int, processes: int) -> list[float]:
    """The per-step µs of every process's timed trials, started together."""
    cmd, env = command(config, reads)
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(processes)]
    times = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{config} ({reads} reads) failed: {err.strip().splitlines()[-1:]}")
        times.extend(json.loads(out.strip().splitlines()[-1])[1:])
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,4", help="process counts, comma-separated")
    parser.add_argument("--reads", default="2,3", help="reads per step (2 or 3), comma-separated")
    parser.add_argument("--configs", default="stock,managed-pool,auto,device")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker is not None:
        print(json.dumps(_step_loop(opts.worker)))
        return 0
    configs = opts.configs.split(",")
    cases = [(int(p), int(r)) for p in opts.processes.split(",") for r in opts.reads.split(",")]
    times = {}
    for r in range(opts.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for processes, reads in cases:
            for config in order:
                got = run(config, reads, processes)
                times.setdefault((processes, reads, config), []).extend(got)
                print(f"round {r + 1}, {processes} processes, {reads} reads, {config}: "
                      + " ".join(f"{t:.0f}" for t in got), flush=True)
    print("processes | reads | " + " | ".join(configs) + "  (µs per step, median; × the first)")
    for processes, reads in cases:
        medians = [statistics.median(times[processes, reads, c]) for c in configs]
        cells = [f"{m:.0f}" + ("" if i == 0 else f" ×{m / medians[0]:.2f}") for i, m in enumerate(medians)]
        print(f"{processes} | {reads} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
