"""Run CuPy's own tests (a checkout of its tests/ folder) with and without ump.

    python tools/cupy_suite.py TESTS_DIR OUT_DIR [pytest args...]
    UMP_SUITE_RUNS=stock python tools/cupy_suite.py ...   # one side only
    python tools/cupy_suite.py --compare STOCK.xml UMP.xml

The "stock" run is CuPy as shipped (CUPY_ENABLE_UMP unset: its own UMP path
fails on GPUs without HMM/ATS). The "ump" run replaces the UMP recipe in
CuPy's tests/conftest.py with ``ump.enable()`` and sets CUPY_ENABLE_UMP=1.
Each run writes JUnit XML; the script prints both counts and every test whose
outcome differs.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

RECIPE = "if int(os.environ.get('CUPY_ENABLE_UMP', 0)) != 0:\n    # Make sure malloc"
PRELUDE = '''import os as _os
if _os.environ.get("UMP_CUPY_SUITE") == "1":
    import ump
    ump.enable(cap=int(_os.environ.get("UMP_CUPY_SUITE_CAP", str(4 << 30))))
'''


def patch_conftest(tests: pathlib.Path) -> None:
    conftest = tests / "conftest.py"
    text = conftest.read_text()
    if PRELUDE in text:
        return
    if RECIPE not in text:
        raise SystemExit(f"{conftest}: CuPy's UMP recipe not found; is this CuPy v14.2.0?")
    text = text.replace(RECIPE, "if False:  # replaced by ump.enable() above\n    # Make sure malloc")
    conftest.write_text("from __future__ import annotations\n" + PRELUDE
                        + text.replace("from __future__ import annotations\n", "", 1))


def outcomes(xml_path: pathlib.Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
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
    patch_conftest(tests)
    wanted = os.environ.get("UMP_SUITE_RUNS", "stock,ump").split(",")
    runs = {}
    for label, extra_env in (("stock", {}), ("ump", {"UMP_CUPY_SUITE": "1", "CUPY_ENABLE_UMP": "1"})):
        if label not in wanted:
            continue
        env = {k: v for k, v in os.environ.items() if k not in ("CUPY_ENABLE_UMP", "UMP_CUPY_SUITE")}
        env.update(extra_env)
        xml = out / f"cupy-suite-{label}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
        proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True)
        (out / f"cupy-suite-{label}.log").write_text(proc.stdout[-200_000:] + proc.stderr[-50_000:])
        runs[label] = outcomes(xml)
        counts = {k: sum(1 for v in runs[label].values() if v == k) for k in ("passed", "failed", "skipped")}
        print(f"{label}: {counts}", flush=True)
    if len(runs) == 2:
        report(runs["stock"], runs["ump"])


if __name__ == "__main__":
    main(sys.argv[1:])
