"""The perf suite: its CPU smoke mode runs, and --compare catches slow-downs."""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import subprocess
import sys

import pytest

from _bench_cli import bench_cli, usage_error

from ump import bench
from ump._vmm import VMMPool
from ump.bench import cases
from ump.bench import progress as bench_progress

MiB = 1 << 20


def _report(median, spread=0.02, case="np.empty 64B", config="stock"):
    times = [median * (1 + spread * k) for k in (-2, -1, 0, 1, 2)]
    return {"configs": [config], "results": {case: {"suite": "alloc_numpy", config: {
        "cpu": bench.summary(times), "gpu": None, "cpu_times": times, "gpu_times": []}}}}


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
    run = bench_cli(tmp_path, "--smoke", "--suites", "alloc_numpy", "--output", str(out), "--plot", "")
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert "np.empty 1MiB" in report["results"] and "stock" in report["configs"]
    assert "partial" not in report and not (tmp_path / "a.partial.json").exists()
    assert "| np.empty 64B |" in run.stdout
    # the same run compared with itself passes...
    same = bench_cli(tmp_path, "--compare", str(out), "--input", str(out))
    assert same.returncode == 0 and "no slow-down" in same.stdout
    # ...and one made slower on purpose fails: 10x, times the run's own
    # max/min spread, which on a loaded machine can exceed 10x by itself
    slowed = copy.deepcopy(report)
    entry = slowed["results"]["alloc/free churn (256 arrays)"]["stock"]
    factor = 10 * entry["cpu"]["max"] / entry["cpu"]["min"]
    entry["cpu"] = {k: (v * factor if isinstance(v, float) else v) for k, v in entry["cpu"].items()}
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps(slowed))
    flagged = bench_cli(tmp_path, "--compare", str(out), "--input", str(bad))
    assert flagged.returncode == 1 and "SLOWER: alloc/free churn" in flagged.stdout


def test_overhead_reports_ratio_spread_and_difference():
    report = _report(10.0, case="add 100x100")
    report["configs"] = ["stock", "imported"]
    per = report["results"]["add 100x100"]
    per["stock"]["round_cpu"] = [10.0, 10.2]
    per["imported"] = copy.deepcopy(per["stock"])
    per["imported"]["cpu"] = bench.summary([10.1, 10.15, 10.2])
    per["imported"]["round_cpu"] = [10.1, 10.2]
    (line,) = bench.overhead(report)
    assert "add 100x100 [imported]: CPU ×1.015" in line
    assert "rounds 1.000–1.010" in line and "+0.15 µs" in line


def test_rounds_interleave_configurations(tmp_path):
    out = tmp_path / "r.json"
    run = bench_cli(tmp_path, "--smoke", "--suites", "alloc_numpy", "--rounds", "2", "--output", str(out),
                 "--plot", "")
    assert run.returncode == 0, run.stderr
    assert "round 2/2" in run.stderr
    # inside every configuration, each suite as it starts, with the time left once one has ended
    report = json.loads(out.read_text())
    n, last = 2 * len(report["configs"]), report["configs"][-1]  # the machine's configurations
    assert f"  stock: alloc_numpy (suite 1/{n}, " in run.stderr
    assert re.search(rf"  {last}: alloc_numpy \(suite {n}/{n}, \d+ s so far, about \d+ s left\)",
                     run.stderr), run.stderr
    entry = report["results"]["np.empty 64B"][report["configs"][-1]]  # a ump configuration
    assert len(entry["round_cpu"]) == 2 and entry["cpu"]["n"] == len(entry["cpu_times"])


def test_help_lists_the_suites_and_configurations(tmp_path):
    run = bench_cli(tmp_path, "--help")
    assert run.returncode == 0, run.stderr
    listed = {line.split()[0] for line in run.stdout.splitlines() if line.startswith("  ") and
              not line.lstrip().startswith("-")}
    assert set(bench.CPU_SUITES) | set(bench.GPU_SUITES) | set(bench.KNOWN_CONFIGS) <= listed
    for name in bench.ON_REQUEST:
        assert any(line.split()[0] == name and "only when named" in line for line in run.stdout.splitlines()
                   if line.startswith("  "))


@pytest.mark.parametrize("flag, path, why", [
    ("--output", "/proc/no-such-dir/r.json", "No such file or directory"),
    ("--output", ".", "Is a directory"),
    ("--plot", "/proc/no-such-dir/p.png", "No such file or directory"),
])
def test_an_output_it_cannot_write_is_refused_before_the_run(tmp_path, flag, path, why):
    """A long run must not lose its results to a path it cannot write at its end."""
    args = {"--output": str(tmp_path / "r.json"), "--plot": "", flag: path}
    line = usage_error(bench_cli(tmp_path, "--smoke", *(x for kv in args.items() for x in kv)))
    assert line.startswith(f"python -m ump bench: error: {flag}: cannot write ") and line.endswith(why)
    assert not (tmp_path / "r.json").exists()


def test_a_writable_output_is_checked_without_a_trace(tmp_path):
    """The check leaves no empty file where the run fails (no results)."""
    out = tmp_path / "new" / "r.json"
    run = bench_cli(tmp_path, "--suites", "interop", "--output", str(out))  # refused later, or run on a GPU
    assert run.returncode in (0, 2) and (out.exists() == (run.returncode == 0)), run.stderr
    assert not (tmp_path / "new" / "r.partial.json").exists()


def test_an_output_whose_partial_report_cannot_be_written_is_refused(tmp_path):
    """The partial reports go beside --output: a path there the run could
    not write is refused before anything runs, as --output itself is."""
    (tmp_path / "r.partial.json").mkdir()
    line = usage_error(bench_cli(tmp_path, "--smoke", "--output", str(tmp_path / "r.json"), "--plot", ""))
    assert line.endswith(f"--output: cannot write {tmp_path / 'r.partial.json'}: Is a directory")
    assert not (tmp_path / "r.json").exists()


def test_unknown_suite_names_the_known_ones(tmp_path):
    out = tmp_path / "r.json"
    line = usage_error(bench_cli(tmp_path, "--suites", "alloc_numpy,nosuch", "--output", str(out)))
    assert "unknown suite 'nosuch'" in line
    assert all(name in line for name in (*bench.CPU_SUITES, *bench.GPU_SUITES))
    assert not out.exists()


def test_unknown_configuration_names_the_known_ones(tmp_path):
    out = tmp_path / "r.json"
    line = usage_error(bench_cli(tmp_path, "--configs", "stock,bogus", "--output", str(out)))
    assert "unknown configuration 'bogus'" in line
    assert all(name in line for name in bench.KNOWN_CONFIGS)
    assert not out.exists()


def test_suite_or_configuration_the_machine_cannot_run(tmp_path, caps):
    if caps.gpu and caps.cupy_version is not None:
        pytest.skip("this machine runs the GPU suites and backends")
    line = usage_error(bench_cli(tmp_path, "--suites", "interop"))
    assert "suite 'interop' cannot run on this machine" in line and "it runs alloc_numpy" in line
    line = usage_error(bench_cli(tmp_path, "--suites", "vmm"))
    assert "suite 'vmm' cannot run on this machine" in line
    line = usage_error(bench_cli(tmp_path, "--configs", "managed:host"))
    assert "configuration 'managed:host' cannot run on this machine" in line


def test_compare_with_a_missing_or_foreign_file(tmp_path):
    line = usage_error(bench_cli(tmp_path, "--compare", "missing.json"))
    assert line.endswith("--compare: file not found: missing.json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    line = usage_error(bench_cli(tmp_path, "--compare", "other.json", "--input", "other.json"))
    assert "other.json is not a bench report" in line
    (tmp_path / "no_configs.json").write_text('{"results": {}}')
    assert "is not a bench report" in usage_error(bench_cli(tmp_path, "--input", "no_configs.json"))
    (tmp_path / "text.json").write_text("not json")
    assert "text.json is not JSON" in usage_error(bench_cli(tmp_path, "--compare", "text.json"))
    assert "--input: text.json is not JSON" in usage_error(bench_cli(tmp_path, "--input", "text.json"))


@pytest.mark.parametrize("rounds", ["0", "-1", "two"])
def test_rounds_below_one_are_rejected_and_keep_the_results_file(tmp_path, rounds):
    out = tmp_path / "r.json"
    out.write_text('{"results": {"kept": {}}}')
    line = usage_error(bench_cli(tmp_path, "--smoke", "--rounds", rounds, "--output", str(out), "--plot", ""))
    assert "argument --rounds:" in line
    assert out.read_text() == '{"results": {"kept": {}}}'
    with pytest.raises(bench.ArgumentError, match="rounds must be an int >= 1"):
        bench.run(suites=["alloc_numpy"], rounds=0)


def test_skipped_gpu_suites_and_an_unwritten_plot_are_reported(tmp_path, caps):
    if caps.gpu and caps.cupy_version is not None:
        pytest.skip("this machine runs the GPU suites")
    plot = tmp_path / "p.png"
    run = bench_cli(tmp_path, "--smoke", "--output", str(tmp_path / "r.json"), "--plot", str(plot))
    assert run.returncode == 0, run.stderr
    skipped = [line for line in run.stderr.splitlines() if line.startswith("GPU suites skipped")]
    assert len(skipped) == 1 and all(name in skipped[0] for name in bench.GPU_SUITES)
    assert ("no GPU" in skipped[0]) if not caps.gpu else ("CuPy is not installed" in skipped[0])
    assert f"plot not written ({plot}): no interop cases in this run" in run.stderr
    assert not plot.exists()


def test_plot_without_matplotlib_is_reported(tmp_path, monkeypatch, capsys):
    report = _report(50.0, case="asarray 1MiB")
    monkeypatch.setattr(bench, "run", lambda **kwargs: report)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    plot = tmp_path / "p.png"
    args = argparse.Namespace(compare=None, input=None, suites=None, configs=None, smoke=True, rounds=1,
                              output=str(tmp_path / "r.json"), plot=str(plot), threshold=1.25)
    assert bench.main(args) == 0
    assert f"plot not written ({plot}): matplotlib is not installed" in capsys.readouterr().err
    assert not plot.exists()


def test_progress_estimates_from_each_suites_own_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(bench_progress.time, "perf_counter", lambda: now[0])
    out = io.StringIO()
    shown = bench_progress.Progress([("stock", "slow"), ("stock", "fast"), ("host", "slow"), ("host", "fast")], out)
    assert shown.left() is None  # nothing measured yet
    shown.start("stock", "slow")
    now[0] = 10.0
    shown.end("stock", "slow")
    shown.start("stock", "fast")
    now[0] = 11.0
    shown.end("stock", "fast")
    assert shown.left() == 10.0 + 1.0  # host: slow then fast, each as long as in stock
    shown.start("host", "slow")
    now[0] = 15.0
    assert shown.left() == 7.0  # 4 s into the slow one, then the fast one
    assert "stock: fast (suite 2/4, 10 s so far, about 30 s left)" in out.getvalue()  # unknown: as the mean
    assert "host: slow (suite 3/4, 11 s so far, about 11 s left)" in out.getvalue()


def test_progress_draws_a_bar_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm", reason="the bar needs tqdm (pip install ump-unified-memory[bench])")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    shown = bench_progress.Progress([("stock", "a"), ("host", "a")], out)
    shown.start("stock", "a")
    shown.end("stock", "a")
    shown.start("host", "a")
    shown.say("a line above the bar")
    shown.close()
    text = out.getvalue()
    assert "host: a" in text and "1/2" in text and " left" in text and "a line above the bar" in text


def test_the_worker_reports_its_suites_as_they_run(tmp_path):
    """A configuration's process says when each suite starts and ends, while
    its results still arrive whole on stdout."""
    cmd = bench._worker("stock", ["alloc_numpy"], True)
    events = []

    class Recorder(bench_progress.Progress):
        def start(self, config, suite):
            events.append(("start", config, suite))

        def end(self, config, suite):
            events.append(("done", config, suite))

    proc = bench_progress.run_worker(cmd, "stock", Recorder([("stock", "alloc_numpy")], io.StringIO()),
                                     cwd=tmp_path)  # where no source tree shadows the installed ump
    assert proc.returncode == 0, proc.stderr
    assert events == [("start", "stock", "alloc_numpy"), ("done", "stock", "alloc_numpy")]
    assert "np.empty 64B" in json.loads(proc.stdout) and "ump-bench-progress" not in proc.stderr


def test_plot_has_a_panel_per_operation(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install ump-unified-memory[bench])")
    import matplotlib.pyplot as plt

    report = {"configs": ["stock", "managed", "pinned"], "results": {}}
    for op in bench.INTEROP_OPS:
        for mib in (1, 16, 256):
            entry = _report(float(mib), case=f"{op} {mib}MiB")["results"][f"{op} {mib}MiB"]
            report["results"][f"{op} {mib}MiB"] = {**entry, "managed": entry["stock"], "pinned": entry["stock"]}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert bench.plot(report, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
    (fig,) = figures
    assert [ax.get_title() for ax in fig.axes] == list(bench.INTEROP_OPS)
    for ax in fig.axes:
        assert [line.get_label() for line in ax.get_lines()] == report["configs"]
        assert all(len(line.get_xdata()) == 3 for line in ax.get_lines())


# --- the vmm suite ------------------------------------------------------------------

def test_vmm_is_a_gpu_suite_run_once_per_run():
    assert "vmm" in bench.GPU_SUITES and "vmm" not in bench.CPU_SUITES
    assert "vmm" in cases.CONFIG_FREE  # it builds its own pools: the "stock" process alone runs it


def test_striped_cases_need_two_gpus_that_reach_each_other():
    assert cases._striped_why_not(1, lambda a, b: 1) == "needs two GPUs, this machine has 1"
    assert cases._striped_why_not(0, lambda a, b: 1) == "needs two GPUs, this machine has 0"
    one_way = cases._striped_why_not(2, lambda a, b: int(a == 0))
    assert one_way and "cannot access each other's memory" in one_way
    assert cases._striped_why_not(2, lambda a, b: 1) is None


def test_a_case_the_machine_cannot_run_is_reported_with_its_reason(monkeypatch):
    """A worker returns such a case as {"skipped": reason} (the striped cases
    on one GPU): the run says so once on stderr, keeps it in the report, and
    does not count it as a result."""
    case, why = cases.STRIPED_CASES[0], "needs two GPUs, this machine has 1"
    worker_out = {"np.empty 64B": {"suite": "alloc_numpy", "cpu": [1.0, 2.0], "gpu": []},
                  case: {"suite": "vmm", "skipped": why}, bench.PROCESS_KEY: {"ump_imported": False}}
    monkeypatch.setattr(bench_progress, "run_worker", lambda cmd, *args, **kw: subprocess.CompletedProcess(
        cmd, 0, stdout=json.dumps(worker_out), stderr=""))
    err = io.StringIO()
    report = bench.run(suites=["alloc_numpy"], configs=["stock"], rounds=2, progress=err)
    assert report["skipped"] == {case: why}
    assert case not in report["results"] and report["results"]["np.empty 64B"]["stock"]["cpu"]["n"] == 4
    assert [line for line in err.getvalue().splitlines() if "skipped" in line] == [
        f"case skipped ({case}): {why}"]
    assert case not in bench.table(report)


def test_the_table_gives_each_rounds_ratio_beside_the_ratio_of_medians(monkeypatch):
    """One process of three that runs every repeat slow moves a ratio of
    medians; the table shows the rounds' own ratios beside it, on the figure
    the case is judged by."""
    def table_of(per_round):
        rounds = {config: iter(times) for config, times in per_round.items()}

        def worker(cmd, config, *args, **kw):
            cpu = next(rounds[config])
            out = {"NumPy only": {"suite": "alloc_numpy", "cpu": cpu, "gpu": []},
                   "a kernel": {"suite": "alloc_numpy", "cpu": [1.0] * 3, "gpu": [c / 10 for c in cpu]},
                   bench.PROCESS_KEY: {"ump_imported": config != "stock"}}
            return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(out), stderr="")

        monkeypatch.setattr(bench_progress, "run_worker", worker)
        report = bench.run(suites=["alloc_numpy"], configs=["stock", "imported"], rounds=len(per_round["stock"]),
                           progress=io.StringIO())
        return {line.split(" | ")[0]: line for line in bench.table(report).splitlines()}

    rows = table_of({"stock": [[430.0] * 3, [433.0] * 3, [430.0] * 3],
                     "imported": [[644.0] * 3, [419.0] * 3, [449.0] * 3]})
    assert rows["| NumPy only"].endswith("| CPU 449.0 µs (×1.04; rounds 0.97–1.50) |")
    assert rows["| a kernel"].endswith("| CPU 1.0 µs, GPU 44.9 µs (×1.04; rounds 0.97–1.50) |")
    rows = table_of({"stock": [[430.0] * 3], "imported": [[644.0] * 3]})  # one round: no spread to give
    assert rows["| NumPy only"].endswith("| CPU 644.0 µs (×1.5) |")


def test_the_tables_rounds_skip_a_failed_run_and_keep_to_the_ratios_figure():
    """A program's failed run leaves its round without a figure (None), and
    a ratio is taken on one figure for both configurations: CPU time where
    either one's GPU time is not what it is judged by."""
    def entry(cpu, gpu, rounds_cpu, rounds_gpu):
        return {"cpu": {"median": cpu}, "gpu": gpu and {"median": gpu},
                "round_cpu": rounds_cpu, "round_gpu": rounds_gpu}

    report = {"configs": ["stock", "auto"], "results": {
        "program p": {"suite": "programs", "stock": entry(100.0, None, [100.0, 100.0, 100.0], []),
                      "auto": entry(110.0, None, [120.0, None, 90.0], [])},
        "mixed": {"suite": "alloc_cupy", "stock": entry(10.0, 1.0, [10.0, 10.0], [1.0, 1.0]),
                  "auto": entry(5.0, 30.0, [5.0, 6.0], [30.0, 30.0])}}}
    rows = {line.split(" | ")[0]: line for line in bench.table(report).splitlines()}
    assert rows["| program p"].endswith("(×1.1; rounds 0.90–1.20) |")
    assert rows["| mixed"].endswith("(×0.5; rounds 0.50–0.60) |")


def test_a_program_that_failed_every_round_is_named_by_the_table_and_compare():
    """No run of a configuration exited 0: its summary is None. The table
    says so where a median would be, and compare names it as worse than
    any slow-down; stock's failures leave the other cells without a ratio."""
    ran = {"cpu": bench.summary([100.0, 101.0]), "gpu": None, "round_cpu": [100.0, 101.0],
           "round_gpu": [], "returncodes": [0, 0]}
    failed = {"cpu": None, "gpu": None, "round_cpu": [None, None], "round_gpu": [],
              "returncodes": [1, 1]}
    new = {"configs": ["stock", "auto"], "results": {"program p": {
        "suite": "programs", "stock": ran, "auto": failed}}}
    assert "| no run exited 0 (exit [1, 1]) |" in bench.table(new)
    old = copy.deepcopy(new)
    old["results"]["program p"]["auto"] = dict(ran)
    assert bench.compare(old, new) == ["program p [auto]: no run exited 0 (exit [1, 1])"]
    assert bench.compare(new, old) == []  # nothing to compare a recovery against
    stock_failed = {"configs": ["stock", "auto"], "results": {"program p": {
        "suite": "programs", "stock": failed, "auto": ran}}}
    assert bench.table(stock_failed).splitlines()[-1].endswith("| CPU 100.5 µs |")


def test_share_case_times_export_and_import_between_two_processes():
    """The share case on the emulated pool (memfds): a spawned process imports
    each export; every step is timed, per GiB, and the importer read the marks
    written at both ends of each allocation (else _share raises)."""
    pool = VMMPool(emulate=True, reserve=1 << 30)
    try:
        out = cases._share(pool, [2 * MiB, 4 * MiB], repeat=2)
        st = pool.statistics()
    finally:
        pool.close()
    assert st.exports == 1 + 2 * 2  # a first, untimed pass, then two per size
    assert (st.views, st.shared_bytes, st.physical_bytes) == (0, 0, 0)  # each allocation closed
    steps = ("export", "import", "reserve + map + set access", "ump.import_handle() in all")
    assert sorted(out) == sorted(f"VMM share {mib}MiB, µs per GiB: {step}" for mib in (2, 4) for step in steps)
    for mib in (2, 4):
        t = {step: out[f"VMM share {mib}MiB, µs per GiB: {step}"] for step in steps}
        assert all(len(e["cpu"]) == 2 and min(e["cpu"]) > 0 and e["gpu"] == [] for e in t.values())
        # the import and the mapping are timed inside the call, so neither exceeds it
        for part in ("import", "reserve + map + set access"):
            assert all(call >= p for call, p in zip(t["ump.import_handle() in all"]["cpu"], t[part]["cpu"]))
        assert set(t["reserve + map + set access"]["metrics"]) == {"reserve", "map", "set access"}


def test_dask_cases_from_a_workflow_report():
    """The dask suite's cases: one per configuration and GPU count, timed per
    run, with throughput and the speed-ups against stock and against 1 GPU."""
    from ump.bench import cases

    def run(config, label, workers, seconds):
        return {"config": config, "label": label, "workers": workers, "seconds": seconds,
                "median_s": sorted(seconds)[len(seconds) // 2]}

    report = {"nbytes": 16 << 30, "runs": [
        run("stock", "stock CuPy", 1, [8.0, 8.5, 7.9]), run("ump", "ump (system)", 1, [4.0]),
        run("stock", "stock CuPy", 2, [4.0]), run("ump", "ump (system)", 2, [2.5])]}
    got = cases.dask_cases(report)
    assert list(got) == ["dask 16GiB, 1 GPU: stock CuPy", "dask 16GiB, 1 GPU: ump (system)",
                         "dask 16GiB, 2 GPUs: stock CuPy", "dask 16GiB, 2 GPUs: ump (system)"]
    assert got["dask 16GiB, 1 GPU: stock CuPy"]["cpu"] == [8e6, 8.5e6, 7.9e6]
    assert got["dask 16GiB, 1 GPU: stock CuPy"]["metrics"] == {"GiB/s": 2.0}
    assert got["dask 16GiB, 2 GPUs: ump (system)"]["metrics"] == {
        "GiB/s": 6.4, "speed-up vs stock": 1.6, "speed-up vs 1 GPU": 1.6}


def test_a_suite_whose_package_is_missing_is_named(monkeypatch):
    monkeypatch.setitem(bench.NEEDS, "dask", ("no_such_module_of_ump", "pip install it"))
    assert bench._suite_missing("dask", None) == "no_such_module_of_ump is not installed (pip install it)"
    assert bench._suite_missing("dask", "no GPU") == "no GPU"
    assert bench._suite_missing("alloc_numpy", "no GPU") is None
    assert "dask" in bench.GPU_SUITES and "dask" in bench.CONFIG_FREE


def test_suites_with_their_own_configurations_run_once(monkeypatch, tmp_path):
    """Suites that set up their own configurations (pools, dask) measure
    ump's own code: they run in the "imported" process alone, not once per
    configuration, and a run that names other configurations gets that
    process too."""
    monkeypatch.setattr(bench, "CONFIG_FREE", {"alloc_numpy"})
    monkeypatch.chdir(tmp_path)  # the workers start here, where no source tree shadows the installed ump
    report = bench.run(suites=["alloc_numpy"], smoke=True, progress=io.StringIO())
    assert report["configs"] == ["imported"]
    assert set(report["results"]["np.empty 64B"]) == {"suite", "imported"}
    report = bench.run(suites=["alloc_numpy"], smoke=True, configs=["stock"], progress=io.StringIO())
    assert report["configs"] == ["stock", "imported"]


def test_the_stock_process_never_imports_ump(tmp_path):
    """"stock" is CuPy and NumPy alone: its worker starts by path and reads
    the cases without the package; "imported" has ump in sys.modules."""
    imported = {}
    for config in ("stock", "imported"):
        proc = subprocess.run(bench._worker(config, ["alloc_numpy"], True), capture_output=True,
                              text=True, check=True, cwd=tmp_path)
        imported[config] = json.loads(proc.stdout)[bench.PROCESS_KEY]["ump_imported"]
    assert imported == {"stock": False, "imported": True}


# --- the moves suite --------------------------------------------------------------

def test_moves_is_a_gpu_suite_run_once_per_run():
    assert "moves" in bench.GPU_SUITES and "moves" not in bench.CPU_SUITES
    assert "moves" in cases.CONFIG_FREE  # it makes its own managed buffers


@pytest.mark.parametrize("count, threads", [(1, 8), (7, 8), (1 << 16, 8), (1001, 3)])
def test_the_threaded_copy_copies_every_element(count, threads):
    import numpy as np

    src = np.arange(1, count + 1, dtype=np.float32)
    dst = np.zeros_like(src)
    cases._threaded_copy(dst, src, threads)
    assert np.array_equal(dst, src)


@pytest.mark.gpu
def test_moves_time_each_way_and_check_what_arrives(gpu_caps):
    """On the GPU, in smoke size: every way is timed, per GiB, and its checks
    of the pages that arrive passed (else the suite raises). The ways that
    discard managed pages run wherever the driver and cuda-bindings are CUDA 13."""
    from cuda.bindings import driver

    from ump._cupy_compat import import_cupy

    import_cupy()
    out = cases.moves(True)
    assert list(out) == list(cases.MOVES_CASES)
    if not gpu_caps.devices[0].concurrent_managed_access:
        assert all("no concurrent managed access" in e["skipped"] for e in out.values())
        return
    can_discard = (hasattr(driver, "cuMemDiscardAndPrefetchBatchAsync")
                   and driver.cuDriverGetVersion()[1] >= 13000)
    timed = cases.MOVES_CASES if can_discard else cases.MOVES_CASES[:4]
    for case in timed:
        entry = out[case]
        assert "skipped" not in entry, (case, entry)
        assert len(entry["cpu"]) == 2 and min(entry["cpu"]) > 0 and entry["metrics"]["ms per GiB"] > 0

# --- the workflows, with NumPy standing in for CuPy ----------------------------

def _numpy_as_cupy():
    """A module that answers what the workflows ask of CuPy, with NumPy: the
    workflows' own checks of what the host reads then run on the CPU."""
    import types

    import numpy as np

    rng = np.random.default_rng(0)
    runtime = types.SimpleNamespace(deviceSynchronize=lambda: None)
    def same(a):  # ump's hand-off keeps the memory: a kernel's writes show on the host side
        return a

    return types.SimpleNamespace(
        asarray=same, asnumpy=same, float32=np.float32,
        random=types.SimpleNamespace(random=lambda n, dtype: rng.random(n, dtype=dtype)),
        cuda=types.SimpleNamespace(runtime=runtime))


@pytest.mark.parametrize("name", ["_pass", "_resident", "_cupy_made", "_many", "_numpy_only"])
def test_workflows_check_what_the_host_reads(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "cupy", _numpy_as_cupy())
    run = getattr(cases, name)
    out = run(1, True) if name == "_pass" else run(True)
    assert len(out["cpu"]) == 3 and min(out["cpu"]) > 0 and out["gpu"] == []



def test_a_run_of_every_suite_leaves_out_those_run_on_request(monkeypatch):
    """The Dask workflow takes minutes: only `--suites dask` runs it."""
    asked = []

    def worker(cmd, *args, **kw):
        asked.append(cmd[-2].split(","))
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({bench.PROCESS_KEY: {"ump_imported": False}}),
                                           stderr="")

    monkeypatch.setattr(bench_progress, "run_worker", worker)
    err = io.StringIO()
    bench.run(configs=["stock"], rounds=1, progress=err)
    assert asked and all("dask" not in suites for suites in asked)
    assert "suite dask runs only when named (--suites dask)" in err.getvalue()


def _one_case_workers(monkeypatch, fail_at=None):
    """Stand-ins for the worker processes: each reports one case (three
    repeats, median 2.0); the ``fail_at``-th fails as a machine taken back."""
    calls = []

    def worker(cmd, *args, **kw):
        calls.append(cmd)
        if len(calls) == fail_at:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="the machine was taken back")
        timings = {"np.empty 64B": {"suite": "alloc_numpy", "cpu": [1.0, 3.0, 2.0], "gpu": []},
                   bench.PROCESS_KEY: {"ump_imported": False}}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(timings), stderr="")

    monkeypatch.setattr(bench_progress, "run_worker", worker)


def test_each_configurations_process_leaves_a_partial_report(monkeypatch):
    """Between the configurations' processes too, the report so far is
    handed to the checkpoint, summarised as the final one; the final report
    is not marked partial."""
    _one_case_workers(monkeypatch)
    saved = []
    final = bench.run(suites=["alloc_numpy"], configs=["stock"], rounds=2, progress=io.StringIO(),
                      checkpoint=saved.append)
    # each a copy: the first still says one process after the second ran
    assert [s["results"]["np.empty 64B"]["stock"]["round_cpu"] for s in saved] == [[2.0], [2.0, 2.0]]
    assert [len(s["processes"]) for s in saved] == [1, 2]
    assert all(s["partial"] is True and s["cpus"] == final["cpus"] for s in saved)
    assert saved[0]["results"]["np.empty 64B"]["stock"]["cpu"]["n"] == 3
    assert "partial" not in final and final["results"] == saved[-1]["results"]


def _bench_args(tmp_path, **more):
    return argparse.Namespace(**{**dict(compare=None, input=None, suites="alloc_numpy", configs="stock", smoke=True,
                                        rounds=2, output=str(tmp_path / "bench.json"), plot="", threshold=1.25),
                                 **more})


def test_the_command_keeps_the_last_report_whole_until_its_run_ends(tmp_path, monkeypatch, capsys):
    """``python -m ump bench`` writes what has finished beside --output
    (``bench.partial.json``), so a run cut short leaves the report before
    (often --compare's) as it was; a finished run writes the whole report
    and removes the partial one."""
    _one_case_workers(monkeypatch, fail_at=2)
    out, partial = tmp_path / "bench.json", tmp_path / "bench.partial.json"
    out.write_text(json.dumps(_report(100.0)))
    with pytest.raises(RuntimeError, match="taken back"):
        bench.main(_bench_args(tmp_path, compare=str(out)))
    assert json.loads(out.read_text()) == _report(100.0)
    cut = json.loads(partial.read_text())
    assert cut["partial"] is True and cut["results"]["np.empty 64B"]["stock"]["round_cpu"] == [2.0]
    assert "cpus" in cut and cut["rounds"] == 2
    assert "what had finished is in " + str(partial) in capsys.readouterr().err
    with pytest.raises(bench.ArgumentError, match="writes its partial reports there"):
        bench.main(_bench_args(tmp_path, compare=str(partial)))  # the run would overwrite, then remove it
    assert json.loads(partial.read_text()) == cut
    kept = tmp_path / "cut.json"
    kept.write_text(partial.read_text())
    assert bench.main(_bench_args(tmp_path, compare=str(kept))) == 0
    err = capsys.readouterr().err
    assert f"{kept} is a partial report" in err and f"removing {partial}, an earlier run's" in err
    assert not partial.exists() and "partial" not in json.loads(out.read_text())


def test_a_partial_report_that_cannot_be_written_does_not_stop_the_run(tmp_path, monkeypatch, capsys):
    """A checkpoint is there to keep figures: one that fails (here its path
    is a folder) is said once on stderr, leaves no file half written, and
    the run ends with its whole report."""
    _one_case_workers(monkeypatch)
    (tmp_path / "bench.partial.json").mkdir()
    assert bench.main(_bench_args(tmp_path)) == 0
    err = capsys.readouterr().err
    assert err.count("cannot write") == 1 and "the run goes on" in err
    assert json.loads((tmp_path / "bench.json").read_text())["results"]["np.empty 64B"]["stock"]["cpu"]["n"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.partial.json"]


# --- the CPUs a run's processes run on ----------------------------------------------

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                    reason="pinning a process to CPUs needs os.sched_setaffinity (Linux)")


@needs_affinity
def test_cpus_are_lists_and_ranges_and_what_is_refused_is_named():
    from ump.bench import cpus

    assert cpus.parse("0,2-3", [0, 1, 2, 3]) == [0, 2, 3]
    assert cpus.parse(" 1 ", [0, 1]) == [1]
    for spec, why in (("x", "'x' is not a CPU number or a range a-b"), ("3-1", "'3-1' names no CPU"),
                      ("0,5", "cannot run on CPU 5; it may use 0-3")):
        with pytest.raises(ValueError, match=re.escape(why)):
            cpus.parse(spec, [0, 1, 2, 3])
    assert cpus.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@needs_affinity
def test_every_process_of_a_run_runs_on_the_cpus_named(tmp_path, monkeypatch):
    """Every configuration's process inherits the CPUs, the report says
    which each ran on, and the caller's affinity is given back."""
    from ump.bench import cpus

    monkeypatch.chdir(tmp_path)  # the workers start here, where no source tree shadows the installed ump
    cpu = cpus.allowed()[-1]
    before = os.sched_getaffinity(0)
    err = io.StringIO()
    report = bench.run(suites=["alloc_numpy"], smoke=True, configs=["stock", "imported"], rounds=2,
                       cpus=str(cpu), progress=err)
    assert f"every process runs on CPU {cpu}\n" in err.getvalue()
    assert report["cpus"] == {"asked": str(cpu), "used": [cpu]}
    assert [(p["round"], p["config"], p["cpus"]) for p in report["processes"]] == [
        (1, "stock", [cpu]), (1, "imported", [cpu]), (2, "stock", [cpu]), (2, "imported", [cpu])]
    assert os.sched_getaffinity(0) == before


@needs_affinity
def test_cpus_the_process_cannot_use_are_refused_before_the_run(tmp_path):
    out = tmp_path / "r.json"
    line = usage_error(bench_cli(tmp_path, "--smoke", "--suites", "alloc_numpy", "--cpus", "100000",
                               "--output", str(out)))
    assert "--cpus: this process cannot run on CPU 100000" in line
    assert not out.exists()
