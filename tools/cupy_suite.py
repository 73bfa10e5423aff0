"""Run CuPy's own tests (a checkout of its tests/ folder) with and without ump.

    python tools/cupy_suite.py TESTS_DIR OUT_DIR [pytest args...]

TESTS_DIR is the tests/ folder of a CuPy checkout, with CuPy's pyproject.toml
beside it (its pytest settings: strict markers, warning filters).
    UMP_SUITE_RUNS=stock python tools/cupy_suite.py ...   # one side only
    UMP_SUITE_BACKEND=device python tools/cupy_suite.py ...   # ump with another backend
    UMP_SUITE_TIMEOUT=240 python tools/cupy_suite.py ...  # interrupt each side after 240 s
    UMP_SUITE_GPUS=0,1 python tools/cupy_suite.py ...     # both sides at once, one GPU each
    python tools/cupy_suite.py --compare STOCK.xml UMP.xml
    python tools/cupy_suite.py --stored STORED_DIR
    python tools/cupy_suite.py --unreached TESTS_DIR STORED_DIR [pytest args...]

The "stock" run is CuPy as shipped (CUPY_ENABLE_UMP unset: its own UMP path
fails on GPUs without HMM/ATS). The "ump" run sets CUPY_ENABLE_UMP=1 and adds
ump's packaged pytest plugin (``-p ump.pytest_plugin --ump=BACKEND``) to
CuPy's unchanged test suite; UMP_CUPY_SUITE_CAP (default 4G) is each test
process's budget, so that -n workers together stay within the GPU; set empty,
it leaves the budget to the plugin (ump's default in one process, 0.9 of the
GPU shared by -n workers).
Each run writes JUnit XML; the script prints both counts and every test whose
outcome differs. XML files may be gzipped (the stored baselines are).
``--stored`` reports on every stock-RUN.xml[.gz] and ump-RUN.xml[.gz] in
STORED_DIR together: a side's outcomes are merged in the order of the RUN
names in STORED_DIR/runs.txt (the order the runs were made), so that a later
run's outcome of a test replaces an earlier one's.
``--unreached`` collects the suite (on a GPU: some modules collect only
there) and, against every stock-*.xml[.gz] and ump-*.xml[.gz] in STORED_DIR,
prints each module with fewer results on a side than tests collected, then
those modules on one line, to run next.
"""

from __future__ import annotations

import collections
import gzip
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

def outcomes(xml_path: pathlib.Path) -> dict[str, str]:
    result = {}
    opener = gzip.open if xml_path.suffix == ".gz" else open
    with opener(xml_path, "rb") as f:
        root = ET.parse(f).getroot()
    for case in root.iter("testcase"):
        if not case.get("classname") or not case.get("name"):
            continue  # the empty entry an interrupted run ends with
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = ("failed" if kinds & {"failure", "error"} else
                        "skipped" if "skipped" in kinds else "passed")
    return result


def _counts(run: dict) -> str:
    return " / ".join(str(sum(1 for v in run.values() if v == k)) for k in ("passed", "failed", "skipped"))


def _directory(name: str) -> str:
    # classname: [tests.]cupy_tests.math_tests.test_sumprod.TestSumprod
    parts = name.split("::")[0].split(".")
    rest = parts[parts.index("cupy_tests") + 1:] if "cupy_tests" in parts else parts
    return rest[0] if rest else name  # a directory, or a file at the top (test_cublas)


def report(stock: dict, ump: dict) -> None:
    print("directory: stock passed / failed / skipped | ump passed / failed / skipped")
    for directory in sorted({_directory(n) for n in stock.keys() | ump.keys()}):
        pick = lambda run: {n: v for n, v in run.items() if _directory(n) == directory}
        print(f"  {directory}: {_counts(pick(stock))} | {_counts(pick(ump))}")
    print(f"all: {_counts(stock)} | {_counts(ump)}")
    diffs = sorted(n for n in stock.keys() | ump.keys() if stock.get(n) != ump.get(n))
    print(f"{len(diffs)} tests differ:")
    for name in diffs:
        print(f"  {stock.get(name, 'absent')} -> {ump.get(name, 'absent')}: {name}")


def _module_of(name: str, modules) -> str | None:
    """The collected module (cupy_tests/.../test_x.py) a JUnit name belongs to."""
    parts = name.split("::")[0].split(".")
    parts = parts[parts.index("cupy_tests"):] if "cupy_tests" in parts else parts
    for k in range(len(parts), 0, -1):
        module = "/".join(parts[:k]) + ".py"
        if module in modules:
            return module
    return None


def unreached(collected: collections.Counter, stored: dict) -> list[tuple[str, str, int, int]]:
    """(side, module, results, tests) for each module with fewer results
    than ``collected`` tests on a side (``stored``: side -> outcomes)."""
    rows = []
    for side, ran in stored.items():
        counts = collections.Counter(_module_of(name, collected) for name in ran)
        rows += [(side, module, counts[module], total) for module, total in sorted(collected.items())
                 if counts[module] < total]
    return rows


def stored_outcomes(stored_dir: pathlib.Path) -> dict[str, dict[str, str]]:
    """side -> outcomes of every run stored in ``stored_dir``, merged in the
    order of ``runs.txt`` there (one run name a line, oldest first; ``#``
    starts a comment), or in name order without it."""
    order_file = stored_dir / "runs.txt"
    order = None
    if order_file.exists():
        order = [line.split("#")[0].strip() for line in order_file.read_text().splitlines()]
        order = [name for name in order if name]
    merged = {}
    for side in ("stock", "ump"):
        files = {re.sub(r"\.xml(\.gz)?$", "", xml.name)[len(side) + 1:]: xml
                 for xml in stored_dir.glob(f"{side}-*.xml*")}
        if order is not None:
            unlisted = sorted(set(files) - set(order))
            if unlisted:
                raise SystemExit(f"{order_file} does not list the run(s) {', '.join(unlisted)}: "
                                 "add each where it belongs in the order the runs were made")
        merged[side] = {}
        for run in (order if order is not None else sorted(files)):
            if run in files:
                merged[side].update(outcomes(files[run]))
    return merged


def _collect(tests: pathlib.Path, args) -> tuple[collections.Counter, list[str]]:
    """Tests per module, and the modules that failed to collect."""
    env = {k: v for k, v in os.environ.items() if k != "CUPY_ENABLE_UMP"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *(args or ["cupy_tests"])], cwd=tests, env=env, capture_output=True, text=True,
                          timeout=1200)
    # One line per test, beginning with its path; a parameter's repr may
    # continue on further lines, which begin otherwise.
    found = re.findall(r"^(?:\S*/)?(cupy_tests/\S+?\.py)::", proc.stdout, re.M)
    errors = sorted(set(re.findall(r"^ERROR (?:\S*/)?(cupy_tests/\S+?\.py)", proc.stdout, re.M)))
    if not found:
        raise SystemExit(f"collecting {tests} found no tests:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return collections.Counter(found), errors


def _check_tests_dir(tests: pathlib.Path) -> None:
    parent = tests.resolve().parent
    if not (parent / "pyproject.toml").exists():
        # Without it pytest would take the settings of some enclosing project.
        raise SystemExit(f"{parent}/pyproject.toml is missing: put CuPy's (v14.2.0) there, "
                         "its [tool.pytest.ini_options] are how CuPy runs its tests")


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv[0] == "--compare":
        report(outcomes(pathlib.Path(argv[1])), outcomes(pathlib.Path(argv[2])))
        return
    if argv[0] == "--stored":
        stored = stored_outcomes(pathlib.Path(argv[1]))
        report(stored["stock"], stored["ump"])
        return
    if argv[0] == "--unreached":
        tests, stored_dir = pathlib.Path(argv[1]), pathlib.Path(argv[2])
        _check_tests_dir(tests)
        stored = stored_outcomes(stored_dir)
        collected, errors = _collect(tests, argv[3:])
        rows = unreached(collected, stored)
        for side, module, results, total in rows:
            print(f"{side}: {module} {results} of {total}")
        for module in errors:
            print(f"failed to collect (some modules collect only on a GPU): {module}")
        print(" ".join(sorted({module for _, module, _, _ in rows} | set(errors))))
        return
    tests, out, args = pathlib.Path(argv[0]), pathlib.Path(argv[1]), argv[2:]
    _check_tests_dir(tests)
    wanted = os.environ.get("UMP_SUITE_RUNS", "stock,ump").split(",")
    backend = os.environ.get("UMP_SUITE_BACKEND", "auto")
    cap = os.environ.get("UMP_CUPY_SUITE_CAP", "4G")
    limit = float(os.environ.get("UMP_SUITE_TIMEOUT", "0")) or None  # seconds per side
    # One GPU per side, both running at once (each sees its GPU as device 0).
    gpus = [g for g in os.environ.get("UMP_SUITE_GPUS", "").split(",") if g]
    ump_args = [*_load_plugin(), f"--ump={backend}", *([f"--ump-cap={cap}"] if cap else [])]
    sides = []
    for label, extra_env, plugin in (("stock", {}, []), ("ump", {"CUPY_ENABLE_UMP": "1"}, ump_args)):
        if label not in wanted:
            continue
        env = {k: v for k, v in os.environ.items() if k != "CUPY_ENABLE_UMP"}
        env.update(extra_env)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[len(sides) % len(gpus)]
        name = label if label == "stock" or backend == "auto" else f"{label}-{backend}"
        sides.append((label, name, env, plugin))
    runs = {}
    if gpus:
        started = [_start(tests, out, name, env, plugin, args) for _, name, env, plugin in sides]
        for (label, name, _, _), run in zip(sides, started):
            runs[label] = _finish(name, *run, limit)
    else:
        for label, name, env, plugin in sides:
            runs[label] = _finish(name, *_start(tests, out, name, env, plugin, args), limit)
    if len(runs) == 2:
        report(runs["stock"], runs["ump"])


def _load_plugin() -> list[str]:
    """``-p ump.pytest_plugin`` where ump is not installed (pytest loads an
    installed package's plugin through its entry point, and refuses it twice)."""
    from importlib.metadata import entry_points

    installed = any(ep.value == "ump.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "ump.pytest_plugin"]


def _start(tests, out, name, env, plugin, args):
    xml = out / f"cupy-suite-{name}.xml"
    log = out / f"cupy-suite-{name}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, f"--junitxml={xml}", *args]
    f = open(log, "w")
    # SIGINT as the default in the side, whatever this process inherited: a
    # Python started with it ignored (nohup, a background job) ignores the
    # interrupt that _finish sends, and its interrupted test would run on.
    proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=f, stderr=subprocess.STDOUT,
                            preexec_fn=_default_sigint)
    return proc, f, xml, log, time.monotonic()


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _finish(name, proc, f, xml, log, started, limit):
    """Wait for a side (interrupting it ``limit`` seconds after it started);
    its outcomes."""
    with f:
        try:
            proc.wait(timeout=None if limit is None else max(limit - (time.monotonic() - started), 0))
        except subprocess.TimeoutExpired:
            # pytest writes the JUnit XML of what ran when interrupted
            print(f"{name}: interrupted after {limit:.0f} s", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if not xml.exists():
        raise SystemExit(f"{name}: pytest left no results ({xml}); its log: {log}")
    run = outcomes(xml)
    print(f"{name}: {_counts(run)} (passed / failed / skipped)", flush=True)
    return run


if __name__ == "__main__":
    main(sys.argv[1:])
