"""Time a pytest suite run by several processes on one GPU (pytest-xdist,
``-n N``) under stock CuPy, under stock CuPy over ``cudaMallocManaged``
and under ump's backends, the configurations alternated round by round on
one machine.

    TEST_CUPY_PYLOPS=1 python tools/shared_gpu.py --cwd .progs/pylops -n 4 \\
        --rounds 2 --configs stock,managed-pool,auto,device -- pytests

Configurations: ``stock`` (pytest alone, ``CUPY_ENABLE_UMP`` unset: ump is
never imported), ``managed-pool`` (as stock, with CuPy's own pool over
``cupy.cuda.malloc_managed``, set by this file loaded as a pytest plugin:
what managed memory costs without ump), and any backend name of ump
(``auto``, ``managed``, ``pinned``, ``device``: ``-p ump.pytest_plugin
--ump=NAME``). The caller's ``UMP_*`` settings are not passed on, as in
the bench's programs suite. Prints each run's wall seconds, the tests' seconds summed
per module (from pytest's JUnit report), and where a test's outcome differs
from the first configuration's. Nothing here asserts; run 26 in
docs/performance.md made the same runs by hand.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
MANAGED_POOL = "UMP_TOOL_MANAGED_POOL"  # set in managed-pool runs: the plugin hook below acts


def use_managed_pool() -> None:
    """In a managed-pool run's process: CuPy's pool over managed memory;
    otherwise nothing (tools/shared_step.py's workers call it too)."""
    if os.environ.get(MANAGED_POOL) == "1":
        import cupy

        cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)


def environment(config: str) -> dict:
    """A configuration's environment: the caller's without ump's settings
    (the bench's rule: ``UMP_BACKEND`` left in the shell must not turn
    ``auto`` into another backend), and the managed pool asked for in
    managed-pool runs. Imports ump's bench in this process only, never in
    the ones it starts under stock."""
    from ump.bench.programs import without_ump_settings

    env = without_ump_settings()
    if config == "managed-pool":
        env[MANAGED_POOL] = "1"
    return env


def pytest_configure(config):
    """Loaded as a pytest plugin (``-p shared_gpu``) in managed-pool runs."""
    use_managed_pool()


def command(config: str, workers: int, args: list[str], junit: str) -> tuple[list[str], dict]:
    """The pytest command line and environment of one configuration."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
           f"--junitxml={junit}", *args]
    env = environment(config)
    if config in ("stock", "managed-pool"):
        cmd += ["-p", "no:ump.pytest_plugin"]
        if config == "managed-pool":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
            cmd += ["-p", "shared_gpu"]
    else:
        env["CUPY_ENABLE_UMP"] = "1"
        cmd += ["-p", "ump.pytest_plugin", "--ump" if config == "auto" else f"--ump={config}"]
    return cmd, env


def outcomes(junit: str) -> dict:
    """test id -> (outcome, seconds), from a JUnit report."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        found[f"{case.get('classname')}::{case.get('name')}"] = (outcome, float(case.get("time") or 0))
    return found


def by_module(results: dict) -> dict:
    sums = collections.Counter()
    for test, (_, seconds) in results.items():
        sums[test.split("::")[0]] += seconds
    return sums


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cwd", default=".", help="where pytest runs (the suite's checkout)")
    parser.add_argument("-n", type=int, default=4, help="pytest-xdist workers (default 4)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--configs", default="stock,managed-pool,auto,device")
    parser.add_argument("--modules", type=int, default=8, help="modules to list, slowest first")
    parser.add_argument("--keep", help="a folder to keep each run's JUnit report in (CONFIG-ROUND.xml)")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs")
    opts = parser.parse_args(argv)
    configs = opts.configs.split(",")
    runs = collections.defaultdict(list)  # config -> [(wall, results)]
    if opts.keep:
        os.makedirs(opts.keep, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for config in order:
                junit = os.path.join(opts.keep or tmp, f"{config}-{r}.xml")
                cmd, env = command(config, opts.n, opts.pytest_args, junit)
                start = time.perf_counter()
                proc = subprocess.run(cmd, cwd=opts.cwd, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - start
                last = (proc.stdout.strip().splitlines() or [""])[-1]
                print(f"round {r + 1} {config}: {wall:.1f} s, {last}", flush=True)
                if not os.path.exists(junit):
                    print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
                    return 1
                runs[config].append((wall, outcomes(junit)))
    first = runs[configs[0]][0][1]
    for config in configs:
        for wall, results in runs[config]:
            differ = [t for t in first if results.get(t, ("absent",))[0] != first[t][0]]
            print(f"{config}: wall {wall:.1f} s, tests summed {sum(s for _, s in results.values()):.1f} s, "
                  f"{len(differ)} outcomes differ from {configs[0]}'s" + (f": {differ[:5]}" if differ else ""))
    sums = {c: by_module(runs[c][0][1]) for c in configs}  # first round
    print("module | " + " | ".join(configs) + "  (tests summed, s; first round)")
    for module, _ in sums[configs[0]].most_common(opts.modules):
        print(module + " | " + " | ".join(f"{sums[c][module]:.1f}" for c in configs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
