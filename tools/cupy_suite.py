"""Run CuPy's own tests (a checkout of its tests/ folder) with and without ump.

    python tools/cupy_suite.py TESTS_DIR OUT_DIR [pytest args...]

TESTS_DIR is the tests/ folder of a CuPy checkout, with CuPy's pyproject.toml
beside it (its pytest settings: strict markers, warning filters).
    UMP_SUITE_RUNS=stock python tools/cupy_suite.py ...   # one side only
    UMP_SUITE_BACKEND=device python tools/cupy_suite.py ...   # ump with another backend
    python tools/cupy_suite.py --compare STOCK.xml UMP.xml

The "stock" run is CuPy as shipped (CUPY_ENABLE_UMP unset: its own UMP path
fails on GPUs without HMM/ATS). The "ump" run sets CUPY_ENABLE_UMP=1 and adds
ump's packaged pytest plugin (``-p ump.pytest_plugin --ump=BACKEND``) to
CuPy's unchanged test suite; UMP_CUPY_SUITE_CAP (default 4G) is each test
process's budget, so that -n workers together stay within the GPU.
Each run writes JUnit XML; the script prints both counts and every test whose
outcome differs. XML files may be gzipped (the stored baselines are).
"""

from __future__ import annotations

import gzip
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

def outcomes(xml_path: pathlib.Path) -> dict[str, str]:
    result = {}
    opener = gzip.open if xml_path.suffix == ".gz" else open
    with opener(xml_path, "rb") as f:
        root = ET.parse(f).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = ("failed" if kinds & {"failure", "error"} else
                        "skipped" if "skipped" in kinds else "passed")
    return result


def report(stock: dict, ump: dict) -> None:
    for label, run in (("stock", stock), ("ump", ump)):
        counts = {k: sum(1 for v in run.values() if v == k) for k in ("passed", "failed", "skipped")}
        print(f"{label}: {counts}")
    diffs = sorted(n for n in stock.keys() | ump.keys() if stock.get(n) != ump.get(n))
    print(f"{len(diffs)} tests differ:")
    for name in diffs:
        print(f"  {stock.get(name, 'absent')} -> {ump.get(name, 'absent')}: {name}")


def main(argv):
    if argv[0] == "--compare":
        report(outcomes(pathlib.Path(argv[1])), outcomes(pathlib.Path(argv[2])))
        return
    tests, out, args = pathlib.Path(argv[0]), pathlib.Path(argv[1]), argv[2:]
    if not (tests.parent / "pyproject.toml").exists():
        # Without it pytest would take the settings of some enclosing project.
        raise SystemExit(f"{tests.parent}/pyproject.toml is missing: put CuPy's (v14.2.0) there, "
                         "its [tool.pytest.ini_options] are how CuPy runs its tests")
    wanted = os.environ.get("UMP_SUITE_RUNS", "stock,ump").split(",")
    runs = {}
    backend = os.environ.get("UMP_SUITE_BACKEND", "auto")
    cap = os.environ.get("UMP_CUPY_SUITE_CAP", "4G")
    ump_args = ["-p", "ump.pytest_plugin", f"--ump={backend}", f"--ump-cap={cap}"]
    for label, extra_env, plugin in (("stock", {}, []), ("ump", {"CUPY_ENABLE_UMP": "1"}, ump_args)):
        if label not in wanted:
            continue
        env = {k: v for k, v in os.environ.items() if k != "CUPY_ENABLE_UMP"}
        env.update(extra_env)
        name = label if label == "stock" or backend == "auto" else f"{label}-{backend}"
        xml = out / f"cupy-suite-{name}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, f"--junitxml={xml}", *args]
        proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True)
        (out / f"cupy-suite-{name}.log").write_text(proc.stdout[-200_000:] + proc.stderr[-50_000:])
        runs[label] = outcomes(xml)
        counts = {k: sum(1 for v in runs[label].values() if v == k) for k in ("passed", "failed", "skipped")}
        print(f"{name}: {counts}", flush=True)
    if len(runs) == 2:
        report(runs["stock"], runs["ump"])


if __name__ == "__main__":
    main(sys.argv[1:])
