"""The ``programs`` suite of the perf suite: other people's programs run
unedited under stock Python and ``python -m ump run``, with stand-in
programs."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
from _bench_cli import bench_cli, usage_error

from ump import bench

@pytest.fixture(autouse=True)
def _kernel_cache(tmp_path, monkeypatch):
    """A run of the programs suite marks the kernel cache folder it warms
    (``bench --resume``): the test's own, not the user's."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kernel_cache"))


_FAKE_PROGRAM = """
import os, sys, time
with open(os.environ["FAKE_PROGRAM_LOG"], "a") as f:
    f.write(f"{sys.argv[1:]} {'ump' in sys.modules} {os.environ.get('UMP_LAUNCHED')}\\n")
time.sleep(0.05)
print(" GPU :  0.25 sec")
print(" GPU :  0.5 sec")
sys.exit(int(os.environ.get("FAKE_PROGRAM_EXIT", "0")))
"""


def test_programs_run_unedited_under_stock_python_and_the_launcher(tmp_path, monkeypatch):
    """Each run is a process: stock is plain Python (ump never imported),
    the other configuration ``python -m ump run``; the printed GPU times are
    summed; a warm-up round is not recorded; rounds turn the configurations'
    order, and a program as short as this one runs twice the rounds asked
    for; the table gives ratios, their spread over rounds and the geometric
    mean."""
    from ump.bench import programs

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cg.py").write_text(_FAKE_PROGRAM)
    log = tmp_path / "log"
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(log))
    monkeypatch.setenv("UMP_BACKEND", "bogus")  # the runner starts programs without the caller's UMP_*
    prog = programs.Program("cg", "cg/cg.py", ("--tol", "1"), programs._GPU_SECONDS)
    err = io.StringIO()
    results, skipped = programs.run(["stock", "auto"], 2, {"cupy": str(tmp_path)}, programs=(prog,), progress=err)
    lines = log.read_text().splitlines()
    stock, ump_run = "['--tol', '1'] False None", "['--tol', '1'] True 1"
    # warm-up (stock), 2 rounds, then 2 more for a short program, the order turning each round
    assert lines == [stock, ump_run, stock, stock, ump_run, ump_run, stock, stock, ump_run]
    assert skipped == {}
    per = results["program cg"]
    assert per["stock"]["gpu_times"] == [0.75e6] * 4 and per["auto"]["returncodes"] == [0] * 4
    assert all(t >= 0.05e6 for t in per["stock"]["cpu_times"] + per["auto"]["cpu_times"])
    assert "[9/9] round 4/4 cg [auto]" in err.getvalue() and "left)" in err.getvalue()
    assert ", GPU 0.750 s, exit 0" in err.getvalue()
    text = programs.table({"configs": ["stock", "auto"], "results": results})
    assert "| cg | " in text and "geometric mean of stock / auto, printed GPU time: 1.000 (1 program)\n" in text


_TIMED_PROGRAM = """
import os, sys, time
with open(os.environ["FAKE_PROGRAM_LOG"], "a") as f:
    f.write(f"{sys.argv[1]} {'ump' in sys.modules}\\n")
time.sleep(float(sys.argv[3 if "ump" in sys.modules else 2]))
sys.exit(int(sys.argv[4]))
"""


def test_short_programs_run_more_rounds_than_long_ones(tmp_path, monkeypatch):
    """A program that stock runs in under SHORT_S seconds (its median over
    the first rounds), whichever configuration comes first, goes on to
    ``short_rounds`` rounds, the order of the configurations still turning;
    a longer one, and one whose every run failed, stop at ``rounds``; the
    progress count ends where the run does, and the table says how many
    rounds the programs had."""
    from ump.bench import programs

    monkeypatch.setattr(programs, "SHORT_S", 0.6)
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(tmp_path / "log"))
    progs = []
    for name, stock_s, ump_s, rc in (("quick", 0, 0.7, 0), ("slow", 0.8, 0.8, 0), ("broken", 0, 0, 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.py").write_text(_TIMED_PROGRAM)
        progs.append(programs.Program(name, f"{name}/{name}.py", (name, str(stock_s), str(ump_s), str(rc)), gpus=0))
    err = io.StringIO()
    results, _ = programs.run(["auto", "stock"], 1, {"cupy": str(tmp_path)}, short_rounds=2, programs=progs,
                              progress=err)
    runs = (tmp_path / "log").read_text().splitlines()
    # the warm-up under auto, round 1 stock first, round 2 (quick alone) auto first
    assert [line for line in runs if line.startswith("quick")] == [
        "quick True", "quick False", "quick True", "quick True", "quick False"]
    for name in ("slow", "broken"):
        assert [line for line in runs if line.startswith(name)] == [f"{name} True", f"{name} False", f"{name} True"]
    assert [len(results["program quick"][c]["round_cpu"]) for c in ("stock", "auto")] == [2, 2]
    assert [len(results["program slow"][c]["round_cpu"]) for c in ("stock", "auto")] == [1, 1]
    assert results["program broken"]["stock"]["returncodes"] == [3]
    assert "[11/11] round 2/2 quick [stock]" in err.getvalue()
    text = programs.table({"configs": ["stock", "auto"], "results": results})
    assert "\nrounds: 2 for 1 program, 1 for 2 programs" in text
    for asked in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"--short-rounds must be at least --rounds \(2\), got"):
            programs.run(["stock"], 2, {"cupy": str(tmp_path)}, short_rounds=asked, programs=progs, progress=err)


def test_short_rounds_below_rounds_or_without_the_programs_suite_are_refused(tmp_path):
    out = tmp_path / "r.json"
    line = usage_error(bench_cli(tmp_path, "--suites", "alloc_numpy", "--short-rounds", "4", "--output", str(out)))
    assert line.endswith("--short-rounds is for the programs suite: add --suites programs")
    with pytest.raises(bench.ArgumentError, match=r"--short-rounds must be at least --rounds \(3\), got 2"):
        bench.run(suites=["programs"], rounds=3, short_rounds=2, progress=io.StringIO())
    line = usage_error(bench_cli(tmp_path, "--suites", "programs", "--short-rounds", "0", "--output", str(out)))
    assert "--short-rounds: must be at least 1, got 0" in line
    assert not out.exists()


def test_a_run_cut_short_keeps_what_finished_and_input_prints_it(tmp_path, monkeypatch, caps):
    """The programs suite takes many minutes: after each recorded run the
    report of what finished is written beside the output, marked partial,
    each a copy the run does not change afterwards, so a run stopped midway
    (the machine taken back, Ctrl-C) still gives its table; ``--input``
    alone prints a saved report's tables."""
    from ump.bench import programs

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cg.py").write_text(_FAKE_PROGRAM)
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(tmp_path / "log"))
    prog = programs.Program("cg", "cg/cg.py", (), programs._GPU_SECONDS, gpus=0)  # runs here, GPU or not
    writer, saved = bench._Checkpoints(str(tmp_path / "out" / "bench.json")), []

    def checkpoint(partial):
        writer(partial)
        saved.append(partial)
        if len(saved) == 3:
            raise KeyboardInterrupt  # the fourth of four recorded runs never finishes

    with pytest.raises(KeyboardInterrupt):
        bench._run([], False, ["stock", "auto"], 2, io.StringIO(), caps, {"cupy": str(tmp_path)}, (prog,),
                   pinned=None, checkpoint=checkpoint, short_rounds=programs.short_rounds_of(2))  # as run() settles it
    out = tmp_path / "out" / "bench.partial.json"
    report = json.loads(out.read_text())
    per = report["results"]["program cg"]
    assert report["partial"] is True and report["rounds"] == 2 and report["configs"] == ["stock", "auto"]
    assert report["short_rounds"] == 4  # twice the rounds: what the programs under SHORT_S get
    assert per["auto"]["round_gpu"] == [0.75e6] and per["stock"]["round_gpu"] == [0.75e6, 0.75e6]
    assert per["stock"]["gpu"]["median"] == 0.75e6 and per["auto"]["cpu"]["n"] == 1
    assert report["results"] == saved[-1]["results"]
    # round 1 runs auto, then stock; round 2 stock first: each report as it was handed over
    assert [len(s["results"]["program cg"].get("stock", {}).get("round_cpu", ())) for s in saved] == [0, 1, 2]
    assert [s["results"]["program cg"]["auto"]["cpu"]["n"] for s in saved] == [1, 1, 1]
    assert not list(out.parent.glob("*.part")) and not (tmp_path / "out" / "bench.json").exists()
    shown = bench_cli(tmp_path, "--input", str(out))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("A partial report, written before its run ended")
    assert "| cg | " in shown.stdout and "printed GPU time: 1.000" in shown.stdout


def _cut_short(tmp_path, caps, prog, after: int) -> dict:
    """The partial report of a run of ``prog`` (two rounds, four for a
    program as short as the stand-in) stopped once ``after`` runs were
    recorded."""
    from ump.bench import programs

    writer, saved = bench._Checkpoints(str(tmp_path / "first" / "bench.json")), []

    def checkpoint(partial):
        writer(partial)
        saved.append(partial)
        if len(saved) == after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench._run([], False, ["stock", "auto"], 2, io.StringIO(), caps, {"cupy": str(tmp_path)}, (prog,),
                   pinned=None, checkpoint=checkpoint, short_rounds=programs.short_rounds_of(2))
    return json.loads((tmp_path / "first" / "bench.partial.json").read_text())


@pytest.mark.parametrize("after, ran, total", [
    # stock's first rounds not all kept, so whether the stand-in is short is guessed from its warm-up:
    # the warm-up, the rest of round 1, then rounds 2 to 4
    (1, ["stock", "stock", "stock", "auto", "auto", "stock", "stock", "auto"], 8),
    (2, ["stock", "stock", "auto", "auto", "stock", "stock", "auto"], 7),
    # stock's first rounds kept, so it is known short: the warm-up, round 2's auto, then rounds 3 and 4
    (3, ["stock", "auto", "auto", "stock", "stock", "auto"], 6),
    # the warm-up, then rounds 3 and 4 (the first two were whole and found it short)
    (4, ["stock", "auto", "stock", "stock", "auto"], 5),
    # the warm-up, round 3's stock, round 4 (cut inside the short programs' rounds)
    (5, ["stock", "stock", "stock", "auto"], 4),
    (6, ["stock", "stock", "auto"], 3),
    (7, ["stock", "auto"], 2),
    # nothing: every run was recorded, the report not yet written (no warm-up either)
    (8, [], 0)])
def test_a_run_resumed_from_its_partial_report_runs_only_what_it_lacks(tmp_path, monkeypatch, capsys, caps,
                                                                       after, ran, total):
    """``bench --resume`` goes on with a run of the programs suite that
    stopped: the runs its partial report holds are kept, the rounds and
    their turning order go on where it stopped after one warm-up run, the
    progress counts only what is left, and the report says when the
    partial report it went on with was written."""
    from ump.bench import programs

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cg.py").write_text(_FAKE_PROGRAM)
    log = tmp_path / "log"
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(log))
    prog = programs.Program("cg", "cg/cg.py", (), programs._GPU_SECONDS, gpus=0)
    first = _cut_short(tmp_path, caps, prog, after)
    log.unlink()
    err = io.StringIO()
    elsewhere = {"boot": "another boot", "folder": first["kernel_cache"]["folder"]}  # a machine started anew
    report = bench._run([], False, ["stock", "auto"], 2, err, caps, {"cupy": str(tmp_path)}, (prog,),
                        pinned=None, checkpoint=None, short_rounds=4, kept=programs.kept_runs(first["results"]),
                        resumed={**first, "resumed": ["before"], "kernel_cache": elsewhere})
    lines = log.read_text().splitlines() if log.exists() else []
    assert ["auto" if line.endswith("True 1") else "stock" for line in lines] == ran
    per = report["results"]["program cg"]
    for config in ("stock", "auto"):
        assert per[config]["round_gpu"] == [0.75e6] * 4 and per[config]["returncodes"] == [0] * 4
        assert per[config]["cpu"]["n"] == 4  # summed up anew, kept runs and new
        kept = first["results"]["program cg"].get(config, {}).get("round_cpu", [])
        assert per[config]["round_cpu"][:len(kept)] == kept  # the first run's figures, as recorded
    assert report["resumed"] == ["before", first["time"]] and report["programs"] == ["cg"]
    bench._print_tables(report)
    said = capsys.readouterr().out
    assert said.startswith(f"A run that went on with the runs of the partial report written at before, then "
                           f"{first['time']}:")
    assert f"its {after} runs kept" in err.getvalue()
    assert (f"[{total}/{total}] round 4/4 cg [auto]" in err.getvalue()) == bool(total)
    if after >= 3 and total:  # known short: the count is right from the first line
        assert f"[1/{total}] warm-up cg [stock]" in err.getvalue()


def test_a_run_resumed_in_the_boot_that_wrote_its_report_makes_no_warm_ups(tmp_path, monkeypatch, caps):
    """A partial report records the machine's boot, CuPy's kernel cache
    folder and the token of the mark its run left there; a run going on
    with it in the same boot, with the same folder and the mark still in
    it, finds the kernels its warm-ups compiled and makes none, the rounds
    turning as they would after one, and passes the mark on. A machine
    started anew, another folder, a folder emptied, a relative folder or a
    boot the system does not name: warm-ups again."""
    from ump.bench import programs

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cg.py").write_text(_FAKE_PROGRAM)
    log, boot, cache = tmp_path / "log", tmp_path / "boot_id", tmp_path / "kernel_cache"
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(log))
    monkeypatch.setenv("CUPY_CACHE_DIR", str(cache))
    monkeypatch.setattr(programs, "_BOOT_ID", str(boot))
    boot.write_text("boot-1\n")
    prog = programs.Program("cg", "cg/cg.py", (), programs._GPU_SECONDS, gpus=0)
    first = _cut_short(tmp_path, caps, prog, 3)
    mark = first["kernel_cache"]["mark"]
    assert first["kernel_cache"] == {"boot": "boot-1", "folder": str(cache), "mark": mark}
    assert (cache / f"ump-bench-warmed.{mark}").is_file()  # the folder made, the mark left

    def resumed(report=first):
        if log.exists():
            log.unlink()
        err = io.StringIO()
        out = bench._run([], False, ["stock", "auto"], 2, err, caps, {"cupy": str(tmp_path)}, (prog,),
                         pinned=None, checkpoint=None, short_rounds=4,
                         kept=programs.kept_runs(report["results"]), resumed=report)
        per = out["results"]["program cg"]
        assert [len(per[c]["round_cpu"]) for c in ("stock", "auto")] == [4, 4]
        ran = ["auto" if line.endswith("True 1") else "stock" for line in log.read_text().splitlines()]
        return ran, err.getvalue(), out

    ran, said, out = resumed()  # the rest of round 2, then rounds 3 and 4, in the order of a run with a warm-up
    assert ran == ["auto", "auto", "stock", "stock", "auto"]
    assert "its run warmed: no warm-ups" in said and "warm-up cg" not in said
    assert "[1/5] round 2/2 cg [auto]" in said and "[5/5] round 4/4 cg [auto]" in said
    assert out["kernel_cache"] == first["kernel_cache"]  # passed on: a third call skips them too
    warmed_up = ["stock", "auto", "auto", "stock", "stock", "auto"]
    boot.write_text("boot-2\n")  # the machine started anew
    ran, said, out = resumed()
    assert ran == warmed_up and "[1/6] warm-up cg [stock]" in said
    assert out["kernel_cache"]["mark"] not in (None, mark)  # a new mark for its own warm-ups
    boot.write_text("boot-1\n")
    for name in os.listdir(cache):
        os.unlink(cache / name)  # the folder emptied
    assert resumed()[0] == warmed_up
    other = tmp_path / "other_cache"
    monkeypatch.setenv("CUPY_CACHE_DIR", str(other))  # another folder in the same boot
    assert resumed()[0] == warmed_up
    again = {**first, "kernel_cache": resumed()[2]["kernel_cache"]}  # as if a report made there: no warm-ups
    assert resumed(again)[0] == ["auto", "auto", "stock", "stock", "auto"]
    monkeypatch.setenv("CUPY_CACHE_DIR", "kernels")  # relative: each program's own working folder
    relative = {**first, "kernel_cache": resumed()[2]["kernel_cache"]}
    assert relative["kernel_cache"] == {"boot": "boot-1", "folder": None, "mark": None}
    assert resumed(relative)[0] == warmed_up
    monkeypatch.setenv("CUPY_CACHE_DIR", str(other))
    boot.unlink()  # a system that does not name its boot
    unnamed = {**first, "kernel_cache": resumed(again)[2]["kernel_cache"]}
    assert unnamed["kernel_cache"]["boot"] is None and resumed(unnamed)[0] == warmed_up


def test_a_resumed_run_judges_a_program_short_by_its_first_rounds_and_keeps_what_cannot_run_here(
        tmp_path, monkeypatch):
    """Whether a program is short is judged by its first ``rounds`` rounds
    as in a run that was never cut, not by the short rounds kept after
    them; a kept program this machine cannot run is refused where it has
    runs left, and reported with its kept runs, not as skipped, where it
    has none."""
    from ump.bench import programs

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cg.py").write_text(_FAKE_PROGRAM)
    log = tmp_path / "log"
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(log))
    cg = programs.Program("cg", "cg/cg.py", (), programs._GPU_SECONDS, gpus=0)
    gone = programs.Program("gone", "gone.py", (), needs=("ump_no_such_module",), gpus=0)  # cannot run here

    def entry(walls):
        return {"cpu_times": list(walls), "gpu_times": [], "round_cpu": list(walls), "round_gpu": [None] * len(walls),
                "returncodes": [0] * len(walls), "errors": [], "metrics": {}}

    # stock's first two rounds: 1 and 3 s, a median of 2 (short); with the third kept, 3 s (not short)
    kept = {"program cg": {"suite": "programs", "stock": entry([1e6, 3e6, 9e6]), "auto": entry([1e6, 3e6, 9e6])}}
    results, _ = programs.run(["stock", "auto"], 2, {"cupy": str(tmp_path)}, short_rounds=4, programs=(cg,),
                              progress=io.StringIO(), kept=kept)
    assert len(log.read_text().splitlines()) == 3  # the warm-up, then round 4 under both
    assert [len(results["program cg"][c]["round_cpu"]) for c in ("stock", "auto")] == [4, 4]
    # known long (stock's first rounds 3 s), though its warm-up is quick: round 2's auto only, counted so
    err = io.StringIO()
    results, _ = programs.run(["stock", "auto"], 2, {"cupy": str(tmp_path)}, short_rounds=4, programs=(cg,),
                              progress=err, kept={"program cg": {"suite": "programs", "stock": entry([3e6, 3e6]),
                                                                 "auto": entry([3e6])}})
    assert [len(results["program cg"][c]["round_cpu"]) for c in ("stock", "auto")] == [2, 2]
    assert "[1/2] warm-up cg [stock]" in err.getvalue() and "[2/2] round 2/2 cg [auto]" in err.getvalue()
    with pytest.raises(ValueError, match=r"gone has runs left in the report this run goes on with, and cannot"):
        programs.run(["stock", "auto"], 2, {"cupy": str(tmp_path)}, short_rounds=4, programs=(gone,),
                     progress=io.StringIO(), kept={"program gone": {"suite": "programs", "stock": entry([3e6])}})
    done = {"program gone": {"suite": "programs", "stock": entry([3e6, 3e6]), "auto": entry([3e6, 3e6])}}
    results, skipped = programs.run(["stock", "auto"], 2, {"cupy": str(tmp_path)}, short_rounds=4,
                                    programs=(gone,), progress=io.StringIO(), kept=done)
    assert skipped == {} and results["program gone"]["auto"]["round_cpu"] == [3e6, 3e6]


def test_resume_is_refused_where_its_run_cannot_go_on(tmp_path, caps):
    """A report that is not a partial one of the programs suite, whose
    configurations, rounds, short rounds, programs or CPUs differ from
    this run's, or whose run was on another kind of machine (another GPU,
    driver or library version; none recorded), is refused before anything
    runs, and so is ``--resume`` with ``--input``; a run going on with its
    own partial report keeps it."""
    from ump.bench import programs

    entry = {"cpu_times": [1e6], "gpu_times": [], "round_cpu": [1e6], "round_gpu": [None], "returncodes": [0],
             "errors": [], "metrics": {}}
    every = [p.name for p in programs.PROGRAMS]
    report = {"partial": True, "configs": ["stock", "auto"], "rounds": 2, "short_rounds": 4, "time": "t",
              "programs": every, "cpus": None, "results": {"program cg": {"suite": "programs", "stock": entry}},
              "probe": json.loads(json.dumps(caps.as_dict()))}  # as a report holds it
    without_programs = {k: v for k, v in report.items() if k != "programs"}
    elsewhere = {**report["probe"], "driver_version": 1, "cupy_version": "0.0"}
    cases = [
        (report, {"suites": ["programs", "alloc_numpy"]}, "--suites programs alone"),
        ({**report, "partial": False}, {}, "that report is not partial"),
        (report, {"rounds": 3, "short_rounds": 6}, "its run had --rounds 2, this one 3"),
        (report, {"configs": ["stock", "device"]}, "its run had --configs stock,auto, this one stock,device"),
        (report, {"short_rounds": 5}, "its run had --short-rounds 4, this one 5"),
        (report, {"only": ["gmm"]}, f"its run had programs (--only) {','.join(every)}, this one gmm"),
        ({**report, "programs": ["cg"]}, {}, f"its run had programs (--only) cg, this one {','.join(every)}"),
        (without_programs, {}, "that report does not record which programs its run chose"),
        ({**report, "cpus": {"asked": "0-3"}}, {}, "its run had --cpus 0-3, this one (none)"),
        ({**report, "results": {"program cg": {"suite": "programs", "stock": {"round_cpu": [1]}}}}, {},
         "lacks the runs' lists"),
        ({**report, "results": {"add 100x100": {"suite": "dispatch"}, **report["results"]}}, {},
         "other suites' cases"),
        ({k: v for k, v in report.items() if k != "probe"}, {}, "that report does not record the machine"),
        ({**report, "probe": elsewhere}, {}, f"its run was on another kind of machine (cupy_version 0.0, here "
                                             f"{caps.cupy_version}; driver_version 1, here {caps.driver_version})"),
    ]
    for resume, args, message in cases:
        kwargs = {"suites": ["programs"], "rounds": 2, "short_rounds": 4, **args}
        with pytest.raises(bench.ArgumentError, match=re.escape(message)):
            bench.run(progress=io.StringIO(), resume=resume, **kwargs)
    with pytest.raises(bench.ArgumentError, match="nosuch") as refused:
        bench.run(suites=["programs"], rounds=2, only=["nosuch"], progress=io.StringIO(), resume=report)
    assert not str(refused.value).startswith("--resume")  # --only's own error
    partial = tmp_path / "out.partial.json"
    partial.write_text(json.dumps(report))
    line = usage_error(bench_cli(tmp_path, "--input", str(partial), "--resume", str(partial)))
    assert line.endswith("--resume and --input cannot be combined: --resume runs what a run left, --input runs "
                         "nothing")
    refused = bench_cli(tmp_path, "--suites", "programs", "--rounds", "2", "--output", str(tmp_path / "out.json"),
                        "--resume", str(partial))  # no folder of programs named: refused, here or on a GPU
    assert "--resume" not in usage_error(refused)  # this machine's report, the JSON's lists and all: it may go on
    assert json.loads(partial.read_text()) == report and "removing" not in refused.stderr


def test_resume_names_what_differs_between_the_two_machines():
    """The probes are compared as a report holds them (a tuple read back as
    a list is the same machine); GPUs listed alike are compared field by
    field and the field named, others by their names; a probe that is not
    one is refused as none, without a traceback."""
    h100 = {"index": 0, "name": "NVIDIA H100", "compute_capability": (9, 0), "pageable_memory_access": False}
    ours = {"gpu": True, "devices": (h100,), "driver_version": 13000}
    theirs = json.loads(json.dumps(ours))
    bench._same_machine_kind(theirs, ours)  # the same machine, through JSON
    hmm = {**theirs, "devices": [{**theirs["devices"][0], "pageable_memory_access": True}]}
    two = {**theirs, "devices": [{**theirs["devices"][0], "name": "NVIDIA H200"}] * 2, "driver_version": 12080}
    for probe, message in [
            (hmm, "(GPU 0 pageable_memory_access True, here False)"),
            (two, "(GPUs NVIDIA H200, NVIDIA H200, here NVIDIA H100; driver_version 12080, here 13000)"),
            ({**theirs, "devices": ["garbage"]}, "(GPUs garbage, here NVIDIA H100)"),
            ({**theirs, "devices": None}, "(GPUs None, here NVIDIA H100)"),
            ("not a probe", "that report does not record the machine its run was on")]:
        with pytest.raises(bench.ArgumentError, match=re.escape(message)):
            bench._same_machine_kind(probe, ours)


def test_the_programs_table_says_which_programs_stay_within_the_bound():
    """A program is within 1.05× stock by its ratio of medians, or within the
    spread of its rounds (one round at or under the bound), for its wall time
    and its printed GPU time alike; the others are named with their spread."""
    from ump.bench import programs

    def entry(walls, gpus=None):
        e = {"round_cpu": walls, "cpu": {"median": sorted(walls)[len(walls) // 2]}, "errors": []}
        if gpus is not None:
            e.update(round_gpu=gpus, gpu={"median": sorted(gpus)[len(gpus) // 2]})
        return e

    stock = entry([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    results = {
        "program fast": {"suite": "programs", "stock": stock, "auto": entry([0.9, 1.0, 1.02], [1.0, 1.0, 1.0])},
        "program noisy": {"suite": "programs", "stock": stock, "auto": entry([1.04, 1.2, 1.3], [1.0, 1.0, 1.0])},
        "program slow wall": {"suite": "programs", "stock": stock, "auto": entry([1.1, 1.2, 1.3], [1.0, 1.0, 1.0])},
        "program slow gpu": {"suite": "programs", "stock": stock, "auto": entry([1.0, 1.0, 1.0], [1.06, 1.1, 1.2])},
        "program fails": {"suite": "programs", "stock": stock,
                          "auto": {**entry([0.5, 0.5], [0.5, 0.5]), "errors": [["boom"]], "returncodes": [0, 1, 0]}},
    }
    text = programs.table({"configs": ["stock", "auto"], "results": results})
    assert ("auto within 1.05× stock (wall and printed GPU time): 2 of 5 programs (1 by the ratio of medians, "
            "1 within the spread of their rounds); not: slow wall (wall 1.10–1.30); slow gpu (GPU 1.06–1.20); "
            "fails (exit [0, 1, 0])") in text


def test_the_programs_table_gives_the_short_programs_time_against_stock_pair_by_pair():
    """For programs under 2.5 s of stock wall time, where a once-per-process
    cost weighs, each round's wall time less the same round's stock time:
    their median in ms and how many pairs were longer. Longer programs and
    failed rounds give no pair; a program whose every round failed is not
    counted."""
    from ump.bench import programs

    def entry(walls):
        known = [w for w in walls if w is not None]
        return {"round_cpu": walls, "cpu": {"median": sorted(known)[len(known) // 2]}, "errors": []}

    results = {
        "program short": {"suite": "programs", "stock": entry([1.0e6, 1.0e6, 1.0e6]),
                          "auto": entry([1.04e6, 1.03e6, 0.99e6])},
        "program failed once": {"suite": "programs", "stock": entry([2.0e6, None, 2.0e6]),
                                "auto": entry([None, 2.5e6, 2.02e6])},
        "program long": {"suite": "programs", "stock": entry([30e6, 30e6, 30e6]), "auto": entry([33e6, 33e6, 33e6])},
        "program never ran": {"suite": "programs", "stock": entry([1.0e6, 1.0e6, 1.0e6]),
                              "auto": {"round_cpu": [None, None, None], "cpu": None, "errors": [["boom"]],
                                       "returncodes": [1, 1, 1]}},
    }
    text = programs.table({"configs": ["stock", "auto"], "results": results})
    # pairs: +40, +30, -10 and +20 ms; the long program's +3000 ms is not one
    assert ("auto against stock pair by pair (the processes of one round), the 2 programs under 2.5 s: "
            "a median +25.0 ms (3 of 4 pairs longer)") in text


def test_only_selects_programs_by_name_or_first_words_in_the_suites_order():
    from ump.bench import programs

    assert programs.select(None) == programs.PROGRAMS
    stream = programs.select(["stream"])
    assert len(stream) == 10 and all(p.name.startswith("stream ") for p in stream)
    picked = programs.select(["stream cupy_event", "cg", "cg"])
    assert [p.name for p in picked] == ["cg", "stream cupy_event"]
    assert programs.select(["cupyx.scipy"]) == tuple(p for p in programs.PROGRAMS if p.source == "cupyx-docs")
    with pytest.raises(ValueError, match=r"no program of the programs suite is named 'stre': cg, kmeans"):
        programs.select(["stre"])
    with pytest.raises(ValueError, match=r"is named ''"):
        programs.select([""])  # --only "" names no program; it does not mean all of them


def test_only_without_the_programs_suite_is_refused(tmp_path):
    out = tmp_path / "r.json"
    line = usage_error(bench_cli(tmp_path, "--suites", "alloc_numpy", "--only", "cg", "--output", str(out)))
    assert line.endswith("--only names programs of the programs suite: add --suites programs")
    assert not out.exists()


def test_programs_that_fail_or_need_a_missing_module_are_reported(tmp_path, monkeypatch):
    from ump.bench import programs

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cg.py").write_text(_FAKE_PROGRAM)
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("FAKE_PROGRAM_EXIT", "3")
    fails = programs.Program("cg", "cg/cg.py")
    needs = programs.Program("plots", "cg/cg.py", needs=("no_such_module_here",))
    elsewhere = programs.Program("pylops solver", "pytests/test_solver.py", source="pylops")
    results, skipped = programs.run(["stock"], 1, {"cupy": str(tmp_path)}, warmup=0, short_rounds=1,
                                    programs=(fails, needs, elsewhere), progress=io.StringIO())
    assert skipped["program plots"] == "no_such_module_here is not installed"
    assert skipped["program pylops solver"].startswith("no folder of pylops's programs was named (pip install pylops")
    assert results["program cg"]["stock"]["returncodes"] == [3]
    assert results["program cg"]["stock"]["cpu_times"] == [] and results["program cg"]["stock"]["round_cpu"] == [None]
    assert "exit [3]" in programs.table({"configs": ["stock", "auto"],
                                         "results": {"program cg": {**results["program cg"],
                                                                    "auto": results["program cg"]["stock"]}}})


def test_the_programs_suite_tells_its_sources_apart_and_names_where_to_get_them(tmp_path, monkeypatch):
    from ump.bench import programs

    monkeypatch.delenv(programs.ENV, raising=False)
    with pytest.raises(ValueError, match="git clone .*cupy"):
        programs.folders()
    with pytest.raises(ValueError, match=r"holds no programs the suite knows: none of cg/cg.py \(cupy\), "
                                         r"pytests/test_leastsquares.py \(pylops\)"):
        programs.folders([str(tmp_path)])
    cupy, pylops = tmp_path / "examples", tmp_path / "pylops"
    (cupy / "cg").mkdir(parents=True)
    (cupy / "cg" / "cg.py").write_text("")
    (pylops / "pytests").mkdir(parents=True)
    (pylops / "pytests" / "test_leastsquares.py").write_text("")
    monkeypatch.setenv(programs.ENV, f"{pylops}{os.pathsep}{cupy}")
    assert programs.folders() == {"cupy": str(cupy), "pylops": str(pylops)}
    assert programs.folders([str(cupy)]) == {"cupy": str(cupy)}
    assert programs.command("stock", "x.py", ("-a",))[1:] == ["x.py", "-a"]
    assert programs.command("auto", "x.py")[1:] == ["-m", "ump", "run", "x.py"]
    assert programs.command("managed:migrate", "x.py")[1:] == [
        "-m", "ump", "run", "--backend", "managed", "--placement", "migrate", "x.py"]
    assert programs.command("stock", "t.py", ("-q",), "pytest")[1:] == ["-m", "pytest", "t.py", "-q"]
    assert programs.command("auto", "t.py", (), "pytest")[1:] == ["-m", "ump", "run", "-m", "pytest", "t.py"]


_FAKE_CUPYX = '''
raise RuntimeError("the bench imported cupyx")


def argrelmin(data):
    """Relative minima.

    Examples
    --------
    >>> import os, sys
    >>> log = open(os.environ["FAKE_PROGRAM_LOG"], "a")
    >>> for word in ("docs", str("ump" in sys.modules)):
    ...     log.write(word + " ")
    >>> log.write(os.environ.get("UMP_LAUNCHED", "-") + chr(10))
    """


class KDTree:
    def query(self):
        """No examples here."""
'''

_FAKE_RUNNER = """
import os, sys
with open(os.environ["FAKE_PROGRAM_LOG"], "a") as f:
    f.write(f"runner {sys.argv[1:]} {os.environ.get('TEST_CUPY_PYLOPS')} {'ump' in sys.modules}\\n")
"""


def test_docstring_examples_and_test_runners_run_as_programs(tmp_path, monkeypatch):
    """A cupyx docstring's examples become a script, in order, read from the
    file without importing it; a program run as ``-m MODULE`` gets its
    source's environment; both run under stock and the launcher."""
    from ump.bench import programs

    # The fake cupyx is not on any path (its file raises if imported), so
    # programs that import the real CuPy, the launcher's included, still can.
    site = tmp_path / "site"
    (site / "cupyx" / "scipy").mkdir(parents=True)
    (site / "cupyx" / "scipy" / "fake.py").write_text(_FAKE_CUPYX)
    monkeypatch.setattr(programs, "_cupyx_root", lambda: str(site))
    runners = tmp_path / "runners"
    runners.mkdir()
    (runners / "fakerunner.py").write_text(_FAKE_RUNNER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(runners), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "log"
    monkeypatch.setenv("FAKE_PROGRAM_LOG", str(log))

    script = programs.docstring_script("cupyx/scipy/fake.py:argrelmin", str(tmp_path))
    with open(script) as f:
        assert f.read().startswith("import os, sys\nlog = open(")
    with pytest.raises(ValueError, match="defines no KDTree.nope"):
        programs.docstring_script("cupyx/scipy/fake.py:KDTree.nope", str(tmp_path))
    with pytest.raises(ValueError, match="docstring of KDTree.query .* has no examples"):
        programs.docstring_script("cupyx/scipy/fake.py:KDTree.query", str(tmp_path))
    with pytest.raises(ValueError, match="this CuPy has no cupyx/scipy/gone.py"):
        programs.docstring_script("cupyx/scipy/gone.py:argrelmin", str(tmp_path))

    (tmp_path / "pylops" / "pytests").mkdir(parents=True)
    (tmp_path / "pylops" / "pytests" / "test_leastsquares.py").write_text("")
    docs = programs.Program("doc", "cupyx/scipy/fake.py:argrelmin", source="cupyx-docs")
    runner = programs.Program("runner", "pytests/test_leastsquares.py", ("-q",), source="pylops",
                              module="fakerunner", env=(("TEST_CUPY_PYLOPS", "1"),))
    missing = programs.Program("gone", "cupyx/scipy/fake.py:nothing", source="cupyx-docs")
    results, skipped = programs.run(["stock", "auto"], 1, {"pylops": str(tmp_path / "pylops")}, warmup=0,
                                    short_rounds=1, programs=(docs, runner, missing), progress=io.StringIO())
    assert list(skipped) == ["program gone"] and "defines no nothing" in skipped["program gone"]
    test_file = str(tmp_path / "pylops" / "pytests" / "test_leastsquares.py")
    assert log.read_text().splitlines() == [  # round 1: the second configuration first, warm-up or none
        "docs True 1", "docs False -",
        f"runner ['{test_file}', '-q'] 1 True", f"runner ['{test_file}', '-q'] 1 False"]
    assert results["program doc"]["auto"]["returncodes"] == [0]
    assert results["program runner"]["stock"]["returncodes"] == [0]
