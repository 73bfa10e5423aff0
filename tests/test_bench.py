"""The perf suite: its CPU smoke mode runs, and --compare catches slow-downs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

from ump import bench


def _bench(tmp_path, *args):
    """``python -m ump bench ARGS`` in tmp_path, where no source tree shadows
    the installed ump."""
    return subprocess.run([sys.executable, "-m", "ump", "bench", *args], capture_output=True, text=True,
                          cwd=tmp_path)


def _report(median, spread=0.02, case="np.empty 64B", config="stock"):
    times = [median * (1 + spread * k) for k in (-2, -1, 0, 1, 2)]
    return {"configs": [config], "results": {case: {"suite": "alloc_numpy", config: {
        "cpu": bench._summary(times), "gpu": None, "cpu_times": times, "gpu_times": []}}}}


def test_compare_flags_an_injected_slowdown_and_passes_equal_runs():
    old = _report(100.0)
    assert bench.compare(old, copy.deepcopy(old)) == []
    assert bench.compare(old, _report(104.0)) == []  # within noise
    slow = bench.compare(old, _report(150.0))
    assert len(slow) == 1 and "np.empty 64B" in slow[0]
    # a slow-down hidden in noise (wide spread) is not flagged
    assert bench.compare(_report(100.0, spread=0.4), _report(130.0, spread=0.4)) == []


def test_smoke_run_and_compare_cli(tmp_path):
    out = tmp_path / "a.json"
    run = _bench(tmp_path, "--smoke", "--suites", "alloc_numpy", "--output", str(out), "--plot", "")
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert "np.empty 1MiB" in report["results"] and "stock" in report["configs"]
    assert "| np.empty 64B |" in run.stdout
    # the same run compared with itself passes...
    same = _bench(tmp_path, "--compare", str(out), "--input", str(out))
    assert same.returncode == 0 and "no slow-down" in same.stdout
    # ...and one made slower on purpose fails: 10x, times the run's own
    # max/min spread, which on a loaded machine can exceed 10x by itself
    slowed = copy.deepcopy(report)
    entry = slowed["results"]["alloc/free churn (256 arrays)"]["stock"]
    factor = 10 * entry["cpu"]["max"] / entry["cpu"]["min"]
    entry["cpu"] = {k: (v * factor if isinstance(v, float) else v) for k, v in entry["cpu"].items()}
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps(slowed))
    flagged = _bench(tmp_path, "--compare", str(out), "--input", str(bad))
    assert flagged.returncode == 1 and "SLOWER: alloc/free churn" in flagged.stdout


def test_overhead_reports_ratio_spread_and_difference():
    report = _report(10.0, case="add 100x100")
    report["configs"] = ["stock", "imported"]
    per = report["results"]["add 100x100"]
    per["stock"]["round_cpu"] = [10.0, 10.2]
    per["imported"] = copy.deepcopy(per["stock"])
    per["imported"]["cpu"] = bench._summary([10.1, 10.15, 10.2])
    per["imported"]["round_cpu"] = [10.1, 10.2]
    (line,) = bench.overhead(report)
    assert "add 100x100 [imported]: CPU ×1.015" in line
    assert "rounds 1.000-1.010" in line and "+0.15 µs" in line


def test_rounds_interleave_configurations(tmp_path):
    out = tmp_path / "r.json"
    run = _bench(tmp_path, "--smoke", "--suites", "alloc_numpy", "--rounds", "2", "--output", str(out),
                 "--plot", "")
    assert run.returncode == 0, run.stderr
    assert "round 2/2" in run.stderr
    report = json.loads(out.read_text())
    entry = report["results"]["np.empty 64B"][report["configs"][-1]]  # a ump configuration
    assert len(entry["round_cpu"]) == 2 and entry["cpu"]["n"] == len(entry["cpu_times"])
