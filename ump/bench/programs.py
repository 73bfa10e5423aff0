"""The ``programs`` suite: programs nobody in this project wrote, run
unedited, each under stock ``python`` and under ``python -m ump run``.

The programs are CuPy's own examples (tag v14.2.0), read from a checkout of
CuPy's source: ``UMP_BENCH_PROGRAMS`` (or ``bench --programs``) names its
``examples/`` folder. Each run is a process of its own; what is recorded is
the process's wall time and the GPU time the program prints itself, where it
prints one. A first round, under the first configuration, warms CuPy's
kernel cache and is not recorded; then every round runs every program under every configuration, the order
of the configurations turning from round to round so that slow drift of the
machine spreads over all of them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile
import time

from .summary import summary

__all__ = ["PROGRAMS", "ENV", "Program", "command", "examples_dir", "run", "table"]

#: The variable that names CuPy's ``examples/`` folder.
ENV = "UMP_BENCH_PROGRAMS"
_GPU_SECONDS = r"GPU[^:\n]*:\s*([0-9.]+) sec"  # ' GPU :  1.23 sec', 'GPU (CuPy, ...):\t1.2 sec'


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    path: str                   # under examples/
    args: tuple = ()
    gpu_time: str | None = None  # a regex: group 1 of every match, summed, times `unit`, is its GPU time
    unit: float = 1.0            # seconds per printed unit
    needs: tuple = ()            # modules it imports beyond NumPy and CuPy
    gpus: int = 1


#: The programs, with the arguments that make a run repeatable (sgemm draws
#: its sizes at random otherwise).
PROGRAMS = (
    Program("cg", "cg/cg.py", gpu_time=_GPU_SECONDS),
    Program("kmeans", "kmeans/kmeans.py", gpu_time=_GPU_SECONDS, needs=("matplotlib",)),
    Program("gmm", "gmm/gmm.py", gpu_time=_GPU_SECONDS, needs=("matplotlib", "scipy")),
    Program("black_scholes", "finance/black_scholes.py", gpu_time=_GPU_SECONDS),
    Program("monte_carlo", "finance/monte_carlo.py", gpu_time=_GPU_SECONDS),
    Program("sgemm", "gemm/sgemm.py", ("--m", "1500", "--n", "1500", "--k", "3000"),
            r"time ([0-9.]+) ms", 1e-3),
    Program("stream cublas", "stream/cublas.py"),
    Program("stream cufft", "stream/cufft.py"),
    Program("stream cupy_event", "stream/cupy_event.py"),
    Program("stream cupy_kernel", "stream/cupy_kernel.py"),
    Program("stream cupy_memcpy", "stream/cupy_memcpy.py", gpu_time=r"\(ms\)\n([0-9.]+)", unit=1e-3),
    Program("stream curand", "stream/curand.py"),
    Program("stream cusolver", "stream/cusolver.py"),
    Program("stream cusparse", "stream/cusparse.py"),
    Program("stream map_reduce", "stream/map_reduce.py", gpu_time=r"elapsed time ([0-9.]+)"),
    Program("stream thrust", "stream/thrust.py"),
    Program("jit elementwise", "jit/elmentwise_op.py"),
    Program("jit reduction_atomic", "jit/reduction_atomic.py"),
    Program("jit reduction_simple", "jit/reduction_simple.py"),
    Program("custom_struct builtin_vectors", "custom_struct/builtin_vectors.py"),
    Program("custom_struct complex_struct", "custom_struct/complex_struct.py"),
    Program("custom_struct packed_matrix", "custom_struct/packed_matrix.py"),
)


def examples_dir(path: str | None = None) -> str:
    """The folder holding CuPy's examples: ``path``, else ``UMP_BENCH_PROGRAMS``.

    Raises
    ------
    ValueError
        Neither names a folder with CuPy's examples.
    """
    path = path or os.environ.get(ENV)
    how = ("git clone --depth 1 --branch v14.2.0 https://github.com/cupy/cupy, then "
           f"{ENV}=cupy/examples (or bench --programs cupy/examples)")
    if not path:
        raise ValueError(f"the programs suite runs CuPy's examples: {how}")
    if not os.path.isfile(os.path.join(path, PROGRAMS[0].path)):
        raise ValueError(f"{path} holds no CuPy examples ({PROGRAMS[0].path} is missing): {how}")
    return os.path.abspath(path)


def command(config: str, script: str, args=()) -> list[str]:
    """The command line that runs ``script`` under ``config``: ``stock`` is
    plain Python, which never imports ump; ``auto`` is ``python -m ump run``
    with nothing else; ``BACKEND[:PLACEMENT]`` names them."""
    if config == "stock":
        return [sys.executable, script, *args]
    backend, _, placement = config.partition(":")
    options = [] if backend == "auto" else ["--backend", backend]
    if placement:
        options += ["--placement", placement]
    return [sys.executable, "-m", "ump", "run", *options, script, *args]


def _environment() -> dict:
    """The caller's environment without ump's settings: each configuration
    says all it sets on its command line."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("UMP_") and k != "CUPY_ENABLE_UMP"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _missing(program: Program, gpus: int) -> str | None:
    for module in program.needs:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    if program.gpus > gpus:
        return f"needs {program.gpus} GPU{'s' * (program.gpus > 1)}, this machine has {gpus}"
    return None


def _once(program: Program, config: str, folder: str, cwd: str, timeout: float) -> dict:
    script = os.path.join(folder, program.path)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command(config, script, program.args), cwd=cwd, env=_environment(),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"wall": None, "gpu": None, "rc": None, "error": f"ran past {timeout:.0f} s"}
    wall = time.perf_counter() - start
    gpu = None
    if program.gpu_time is not None:
        found = [float(x) for x in re.findall(program.gpu_time, proc.stdout)]
        gpu = sum(found) * program.unit if found else None
    out = {"wall": wall, "gpu": gpu, "rc": proc.returncode}
    if proc.returncode != 0:
        out["error"] = proc.stderr.strip().splitlines()[-1:] or ["(no message)"]
    return out


def _record(results: dict, program: Program, config: str, one: dict) -> None:
    """Add one recorded run to ``results``. A run that failed counts for
    nothing (a crash is quick); its round keeps its place, as None, so
    rounds pair up."""
    entry = results.setdefault(f"program {program.name}", {"suite": "programs"}).setdefault(
        config, {"cpu_times": [], "gpu_times": [], "round_cpu": [], "round_gpu": [],
                 "metrics": {}, "returncodes": [], "errors": []})
    entry["returncodes"].append(one["rc"])
    if "error" in one:
        entry["errors"].append(one["error"])
    for key, times, rounds in (("wall", "cpu_times", "round_cpu"), ("gpu", "gpu_times", "round_gpu")):
        value = one[key] * 1e6 if one["rc"] == 0 and one[key] is not None else None
        entry[rounds].append(value)
        if value is not None:
            entry[times].append(value)


def run(configs, rounds: int, folder: str, *, warmup: int = 1, gpus: int = 1, timeout: float = 600,
        programs=PROGRAMS, progress=sys.stderr) -> tuple[dict, dict]:
    """(results, skipped): per program and configuration, the wall and
    printed GPU times of ``rounds`` runs (microseconds, as the other suites),
    after ``warmup`` rounds that are not recorded."""
    folder = os.path.abspath(folder)  # the programs run in a folder of their own
    chosen, skipped = [], {}
    for program in programs:
        why = _missing(program, gpus)
        if why is None:
            chosen.append(program)
        else:
            skipped[f"program {program.name}"] = why
            print(f"program skipped ({program.name}): {why}", file=progress, flush=True)
    results: dict = {}
    steps = (warmup + rounds * len(configs)) * len(chosen)
    done, t0 = 0, time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        for r in range(warmup + rounds):
            # Warming CuPy's kernel cache takes one run of each program.
            order = configs[:1] if r < warmup else configs[r % len(configs):] + configs[:r % len(configs)]
            for program in chosen:
                for config in order:
                    done += 1
                    elapsed = time.perf_counter() - t0
                    eta = elapsed / (done - 1) * (steps - done + 1) if done > 1 else math.nan
                    label = "warm-up" if r < warmup else f"round {r - warmup + 1}/{rounds}"
                    print(f"[{done}/{steps}] {label} {program.name} [{config}] "
                          f"({elapsed:.0f} s so far, ~{eta:.0f} s left)", file=progress, flush=True)
                    one = _once(program, config, folder, cwd, timeout)
                    gpu = "" if one["gpu"] is None else f", GPU {one['gpu']:.3f} s"
                    wall = "" if one["wall"] is None else f"{one['wall']:.2f} s"
                    print(f"    {wall}{gpu}, exit {one['rc']}{': ' + str(one['error']) if 'error' in one else ''}",
                          file=progress, flush=True)
                    if r >= warmup:
                        _record(results, program, config, one)
    for per in results.values():
        for config, e in per.items():
            if config != "suite":
                e["cpu"], e["gpu"] = summary(e["cpu_times"]), summary(e["gpu_times"])
    return results, skipped


def _ratio(entry, base, key):
    """(ratio of medians, lowest and highest ratio of one round's to the same
    round's stock) for ``key`` ("cpu": wall, "gpu": printed), or None."""
    if not entry.get(key) or not base.get(key):
        return None
    rounds = "round_cpu" if key == "cpu" else "round_gpu"
    pairs = [a / b for a, b in zip(entry[rounds], base[rounds]) if a is not None and b]
    return entry[key]["median"] / base[key]["median"], min(pairs, default=math.nan), max(pairs, default=math.nan)


def table(report) -> str:
    """The programs' table: wall and printed GPU time per configuration,
    each against stock with the spread of the per-round ratios, and the
    geometric mean of stock / configuration."""
    configs = [c for c in report["configs"] if c != "stock"]
    rows = {case: per for case, per in report["results"].items() if per.get("suite") == "programs"}
    if not rows:
        return ""
    head = "| program | stock wall, GPU (s) | " + " | ".join(f"{c}: wall ×, GPU ×" for c in configs) + " |"
    lines = [head, "|" + "---|" * (len(configs) + 2)]
    speedups = {c: {"cpu": [], "gpu": []} for c in configs}
    for case, per in rows.items():
        base = per.get("stock")
        if base is None:
            continue
        gpu = f", {base['gpu']['median'] / 1e6:.3f}" if base.get("gpu") else ""
        wall = f"{base['cpu']['median'] / 1e6:.2f}" if base.get("cpu") else "no run exited 0"
        cells = [f"{wall}{gpu}"]
        for config in configs:
            entry = per.get(config)
            if entry is None:
                cells.append("")
                continue
            parts = []
            for key in ("cpu", "gpu"):
                r = _ratio(entry, base, key)
                if r is not None:
                    parts.append(f"×{r[0]:.3f} ({r[1]:.2f}–{r[2]:.2f})")
                    speedups[config][key].append(1 / r[0])
            if entry["errors"]:
                parts.append(f"exit {entry['returncodes']}: {entry['errors'][0]}")
            cells.append(", ".join(parts))
        lines.append(f"| {case.removeprefix('program ')} | " + " | ".join(cells) + " |")
    for config in configs:
        for key, what in (("cpu", "wall"), ("gpu", "printed GPU")):
            values = speedups[config][key]
            if values:
                mean = math.exp(sum(math.log(v) for v in values) / len(values))
                lines.append(f"\ngeometric mean of stock / {config}, {what} time: {mean:.3f} "
                             f"({len(values)} programs)")
    return "\n".join(lines)
