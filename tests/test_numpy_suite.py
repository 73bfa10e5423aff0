"""NumPy's own numpy._core tests with ump's allocator, against a plain run.

Both runs use the same NumPy, the same flags and pytest-xdist; the test fails
if any NumPy test passes without ump and fails with it. A few minutes per run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytestmark = pytest.mark.numpy_suite

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"

# Builds a 2**31-element tuple (16 GiB of pointers); NumPy marks it "crashes
# with low memory", and two workers on a small machine run out of it.
DESELECT = "not test_huge_list_error"


def _outcomes(xml_path):
    result = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        result[f"{case.get('classname')}::{case.get('name')}"] = (
            "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    return result


def _run(tmp_path, with_ump):
    pytest.importorskip("xdist", reason="the NumPy suite runs under pytest-xdist (pip install ump[test])")
    xml = tmp_path / ("ump.xml" if with_ump else "stock.xml")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "numpy._core",
            "-o", "addopts=", "-o", "filterwarnings=", "-n", "2", "-k", DESELECT, f"--junitxml={xml}"]
    env = dict(os.environ)
    report = tmp_path / "plugin-report.txt"
    if with_ump:
        args[3:3] = ["-p", "ump_numpy_plugin"]
        env["PYTHONPATH"] = os.pathsep.join([str(TOOLS), env.get("PYTHONPATH", "")])
        env["UMP_PLUGIN_REPORT"] = str(report)
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    if with_ump:
        # the controller and both workers enabled ump
        assert len(report.read_text().splitlines()) >= 3, report.read_text()
    return _outcomes(xml), proc.stdout.strip().splitlines()[-1]


def test_numpy_core_suite_fails_only_where_it_fails_without_ump(tmp_path):
    stock, stock_summary = _run(tmp_path, with_ump=False)
    ump, ump_summary = _run(tmp_path, with_ump=True)
    print(f"\nwithout ump: {stock_summary}\nwith ump:    {ump_summary}")
    assert len(ump) > 10_000, ump_summary  # the suite really ran
    newly_failing = sorted(n for n, o in ump.items() if o == "failed" and stock.get(n) == "passed")
    assert newly_failing == [], newly_failing
    differ = sorted(n for n in stock.keys() | ump.keys() if stock.get(n) != ump.get(n))
    print(f"{len(differ)} outcomes differ: {differ[:20]}")
