"""Time a solver's step on tiny arrays in several processes that share one
GPU, under stock CuPy, stock CuPy over ``cudaMallocManaged`` and ump's
backends: what a test suite run with ``pytest -n 4`` does in each worker
(PyLops's ISTA, LSQR), with nothing else in the way.

    python tools/shared_step.py --processes 1,4 --reads 2,3 \\
        --configs stock,managed-pool,auto,device

The step (``A`` 31 × 11): ``r = y - A @ x``, ``x += 0.01 * A.T @ r``, two
norms, then its reads: with ``--reads 2`` the two scalars a solver reads
(``bool(norm(dx) >= 0)``, ``float(cost)``), with 3 also a small result
copied back (``r[:4].get()``). Each process runs a first trial of 800 steps
(kernels compiled, pools warm), says it is ready, and once every process of
the run is, times three more; the table gives per configuration the median
of all its timed trials (every process, every round), in µs per step, and
that against the first configuration named. Configurations: ``stock``
(ump never imported), ``managed-pool`` (as stock, CuPy's pool over
``cupy.cuda.malloc_managed``: what managed memory costs without ump), and
ump's as the bench names them (``auto``, ``device``, ``managed:host``:
``python -m ump run``); ``UMP_*`` and ``CUPY_ENABLE_UMP`` are not passed
on, as in the bench's programs suite. Configurations alternate round by
round. Nothing here asserts: docs/performance.md (run 28) reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from shared_gpu import environment, use_managed_pool  # beside this file; imports nothing of ump

TRIALS, STEPS = 4, 800
READY = "ready"


def _step_loop(reads: int, ready=None) -> list[float]:
    """µs per step of each timed trial, in this process; ``ready()`` is
    called between the untimed first trial and the timed ones."""
    import cupy

    use_managed_pool()
    cupy.random.seed(0)
    a = cupy.random.randn(31, 11)
    y = a @ cupy.ones(11)
    sync = cupy.cuda.runtime.deviceSynchronize
    per_step = []
    for trial in range(TRIALS):
        if trial == 1 and ready is not None:
            ready()
        x = cupy.zeros(11)
        sync()
        start = time.perf_counter()
        for _ in range(STEPS):
            r = y - a @ x
            previous = x
            x = x + 0.01 * (a.T @ r)
            bool(cupy.linalg.norm(x - previous) >= 0)
            float(0.5 * cupy.linalg.norm(r) ** 2)
            if reads > 2:
                r[:4].get()
        per_step.append((time.perf_counter() - start) / STEPS * 1e6)
    return per_step[1:]


def _wait_for_the_others() -> None:
    print(READY, flush=True)
    sys.stdin.readline()


def command(config: str, reads: int) -> tuple[list[str], dict]:
    """One worker's command line and environment (the bench's command
    line: the worker itself must not import ump, so neither does this file
    until a run is asked for)."""
    from ump.bench.programs import command as program_command

    env = environment(config)
    target = "stock" if config == "managed-pool" else config
    return program_command(target, os.path.abspath(__file__), ["--worker", str(reads)]), env


def run(config: str, reads: int, processes: int) -> list[float]:
    """The per-step µs of every process's timed trials: the processes start
    together and time their trials once every one of them is ready."""
    cmd, env = command(config, reads)
    # stderr into files: a process that writes much there before it is
    # ready would otherwise block on a full pipe while this one reads stdout.
    errs = [tempfile.TemporaryFile("w+") for _ in range(processes)]
    procs = [subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                              text=True) for err in errs]
    try:
        for proc, err in zip(procs, errs):
            if proc.stdout.readline().strip() != READY:
                _fail(config, reads, proc, err)
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        times = []
        for proc, err in zip(procs, errs):
            out, _ = proc.communicate()
            if proc.returncode != 0:
                _fail(config, reads, proc, err)
            try:
                times.extend(json.loads(out.strip().splitlines()[-1]))
            except (IndexError, ValueError):
                raise SystemExit(f"{config} ({reads} reads): no timings in its output {out[-200:]!r}") from None
        return times
    finally:
        for proc, err in zip(procs, errs):  # the others, after one failed; every file closed
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
            err.close()


def _fail(config: str, reads: int, proc, err) -> None:
    proc.kill()
    proc.communicate()
    err.seek(0)
    last = (err.read().strip().splitlines() or ["no output on stderr"])[-1]
    raise SystemExit(f"{config} ({reads} reads) failed: {last}")


def _reads(text: str) -> list[int]:
    reads = [int(r) for r in text.split(",")]
    if any(r not in (2, 3) for r in reads):
        raise argparse.ArgumentTypeError(f"reads per step are 2 or 3, not {text}")
    return reads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,4", help="process counts, comma-separated")
    parser.add_argument("--reads", type=_reads, default=[2, 3], help="reads per step (2 or 3), comma-separated")
    parser.add_argument("--configs", default="stock,managed-pool,auto,device")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker", type=int, choices=(2, 3), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker is not None:
        print(json.dumps(_step_loop(opts.worker, _wait_for_the_others)))
        return 0
    configs = opts.configs.split(",")
    cases = [(int(p), r) for p in opts.processes.split(",") for r in opts.reads]
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
