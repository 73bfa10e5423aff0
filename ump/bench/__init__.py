"""The perf regression suite: stock CuPy vs ump, one process per configuration.

``python -m ump bench`` runs every suite under every configuration the
machine supports ("stock": CuPy in a process that never imports ump;
"imported": ump imported, not enabled; then each backend, and the managed
backend's placements; "auto", what ``ump.enable()`` picks, when named),
prints a table with ratios against stock, writes JSON (with the probe), a
PNG plot of interop time against size, and with ``--compare OLD.json`` flags
slow-downs. Suites that set up their own configurations (``pools``; ``dask``,
the Dask workflow of :mod:`ump.bench.dask_pipeline`) run once, in
"imported". The ``programs`` suite (:mod:`ump.bench.programs`) runs other
people's programs unedited, each run a process of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time

from .. import _probe, backends
from .._version import pip_install
from . import cpus as _cpus
from . import programs
from .summary import round_ratios, summarised, summary
from . import progress as _progress
from .cases import CONFIG_FREE, CPU_SUITES, GPU_SUITES, ON_REQUEST

#: Suites that need a package beyond CuPy: suite -> (module, how to install it).
NEEDS = {"dask": ("distributed", pip_install("dask"))}

#: The suite that runs programs as they are, not cases in a worker.
PROGRAMS = "programs"
#: Its configurations unless named: other people's programs, stock against what a user gets.
PROGRAMS_CONFIGS = ("stock", "auto")

#: The worker's report on its own process, beside the cases.
PROCESS_KEY = "__process__"

__all__ = ["ArgumentError", "configurations", "run", "compare", "table", "plot", "overhead"]

#: Every configuration name the worker understands; configurations() says
#: which of them this machine runs.
KNOWN_CONFIGS = ("stock", "imported", "auto", *backends.names(), "managed:host", "managed:migrate")
#: Where the worker script lies: "stock" runs it by path, so that the
#: package ump is never imported there.
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


class ArgumentError(ValueError):
    """A bad command-line argument: ``python -m ump bench`` reports it on one line."""


def _gpu_missing(caps) -> str | None:
    """Why the GPU suites cannot run here, or None."""
    if not caps.gpu:
        return f"no GPU ({caps.reason})"
    if caps.cupy_version is None:
        return f"CuPy is not installed ({pip_install('cuda12', 'cuda13')})"
    return None


def _suite_missing(suite: str, gpu_missing: str | None) -> str | None:
    """Why ``suite`` cannot run here, or None."""
    if suite in (*GPU_SUITES, PROGRAMS) and gpu_missing is not None:
        return gpu_missing
    module, install = NEEDS.get(suite, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        return f"{module} is not installed ({install})"
    return None


def configurations(caps, smoke: bool) -> list[str]:
    if _gpu_missing(caps) is not None:
        # the host backend runs only where there is no GPU
        return ["stock", "imported"] + ([] if caps.gpu else ["host"])
    usable = [n for n in (*backends.AUTO_ORDER, "device")
              if backends.get(n).unavailable(caps, caps.devices[0]) is None]
    configs = ["stock", "imported"] + usable
    if "managed" in usable and not smoke:
        configs += ["managed:host", "managed:migrate"]
    return configs


def _runnable(caps) -> list[str]:
    """Every configuration this machine can run: the default ones, and
    "auto" where there is a GPU."""
    configs = configurations(caps, smoke=False)
    return configs + (["auto"] if _gpu_missing(caps) is None else [])



def _check_names(kind: str, names, known, runnable, why_not) -> None:
    for name in names:
        if name not in known:
            raise ArgumentError(f"unknown {kind} {name!r}; known: {', '.join(known)}")
        if name not in runnable:
            raise ArgumentError(f"{kind} {name!r} cannot run on this machine: {why_not(name)}; "
                                f"it runs {', '.join(runnable)}")


def _worker(config: str, suites, smoke: bool) -> list[str]:
    head = [sys.executable, WORKER] if config == "stock" else [sys.executable, "-m", "ump.bench.worker"]
    return [*head, config, ",".join(suites), "1" if smoke else "0"]


def _default_suites(runnable_suites, missing, progress) -> list[str]:
    """The suites run when none is named, saying on ``progress`` which are not."""
    for suite in ON_REQUEST:
        print(f"suite {suite} runs only when named (--suites {suite}): {ON_REQUEST[suite]}",
              file=progress, flush=True)
    if missing is not None:
        print(f"GPU suites skipped ({', '.join(GPU_SUITES)}): {missing}", file=progress, flush=True)
    for suite in (*CPU_SUITES, *GPU_SUITES):
        why = _suite_missing(suite, None)
        if why is not None and (suite in CPU_SUITES or missing is None):
            print(f"suite {suite} skipped: {why}", file=progress, flush=True)
    return [s for s in runnable_suites if s not in ON_REQUEST]


def _record(raw: dict, skipped: dict, timings: dict, config: str, progress) -> None:
    """Add one worker's timings of ``config`` to ``raw`` (by case, then
    configuration), and the cases it could not run to ``skipped``."""
    for case, timing in timings.items():
        if "skipped" in timing:  # a case this machine cannot run, and why
            if case not in skipped:
                print(f"case skipped ({case}): {timing['skipped']}", file=progress, flush=True)
            skipped[case] = timing["skipped"]
            continue
        entry = raw.setdefault(case, {"suite": timing["suite"]}).setdefault(
            config, {"cpu_times": [], "gpu_times": [], "round_cpu": [], "round_gpu": [],
                     "metrics": {}})
        for name, value in timing.get("metrics", {}).items():
            entry["metrics"].setdefault(name, []).append(value)
        entry["cpu_times"] += timing["cpu"]
        entry["gpu_times"] += timing["gpu"]
        entry["round_cpu"].append(statistics.median(timing["cpu"]))
        if timing["gpu"]:
            entry["round_gpu"].append(statistics.median(timing["gpu"]))


def run(suites=None, smoke=False, configs=None, rounds=1, progress=sys.stderr,
        programs_dir=None, cpus=None, only=None, checkpoint=None, short_rounds=None, resume=None) -> dict:
    """Run ``suites`` under every configuration, ``rounds`` times interleaved
    (stock, imported, backend, stock, ...), so that slow drift of the machine
    spreads over all configurations; repeats of all rounds are pooled. A
    case this machine cannot run (a worker returns ``{"skipped": reason}``)
    is said on ``progress`` and listed with its reason under ``"skipped"``.
    ``cpus`` (``bench --cpus``, :mod:`ump.bench.cpus`): the CPUs every
    process of the run is pinned to ("0,7,11", "8-15"), which the report's
    ``"cpus"`` keeps; ``"processes"`` says where each configuration's ran.
    ``only`` (``bench --only``): the names of the programs the programs
    suite runs (:func:`ump.bench.programs.select`); None: all.
    ``short_rounds`` (``bench --short-rounds``): the rounds of the short
    programs (:func:`ump.bench.programs.short_rounds_of`).
    ``checkpoint(report)``, if given, is called with a copy of the report
    of what has finished, ``"partial": True`` in it, after each
    configuration's process once any case is recorded, and after each
    recorded run of the programs suite: a run cut short (the machine taken
    back, Ctrl-C) keeps what it measured. ``resume`` (``bench --resume``):
    the partial report of such a run of the programs suite alone, which
    this run goes on with (:func:`_kept`).

    Raises
    ------
    ArgumentError
        An unknown suite or configuration, one this machine cannot run,
        ``rounds`` below 1, CPUs this process cannot run on, ``only``
        without the programs suite or naming no program of it,
        ``short_rounds`` without the programs suite or below ``rounds``, or
        a ``resume`` report this run cannot go on with.
    """
    short_rounds = _rounds_checked(suites, rounds, short_rounds)
    caps = _probe.probe()
    kept = None if resume is None else _kept(resume, suites, configs or list(PROGRAMS_CONFIGS), rounds, short_rounds,
                                             only, cpus, caps.as_dict())
    missing = _gpu_missing(caps)

    def config_why_not(name):
        backend = name.partition(":")[0]
        if backend in backends.names():
            why = backends.get(backend).unavailable(caps, caps.devices[0] if caps.gpu else None)
            if why is not None:
                return why
        return missing

    known_suites = (*CPU_SUITES, *GPU_SUITES, PROGRAMS)
    runnable_suites = [s for s in known_suites if _suite_missing(s, missing) is None]
    if suites is not None:
        _check_names("suite", suites, known_suites, runnable_suites,
                     lambda s: _suite_missing(s, missing))
    if configs:
        _check_names("configuration", configs, KNOWN_CONFIGS, _runnable(caps), config_why_not)
    found, selected = None, ()
    if only is not None and (suites is None or PROGRAMS not in suites):
        raise ArgumentError("--only names programs of the programs suite: add --suites programs")
    if suites is not None and PROGRAMS in suites:
        try:
            selected = programs.select(only)
            found = programs.folders(programs_dir)
        except ValueError as err:
            raise ArgumentError(str(err)) from None
        suites = [s for s in suites if s != PROGRAMS]
    if suites is None:
        suites = _default_suites(runnable_suites, missing, progress)
    if found is not None and not configs:
        configs = list(PROGRAMS_CONFIGS)
    # suites that set up their own configurations run once, in "imported"
    if not configs:
        configs = ["imported"] if set(suites) <= CONFIG_FREE else configurations(caps, smoke)
    elif set(suites) & CONFIG_FREE and "imported" not in configs:
        configs = [*configs, "imported"]
    pinned, before = _pin(cpus, progress) if cpus is not None else (None, None)
    try:
        return _run(suites, smoke, configs, rounds, progress, caps, found, selected, pinned, checkpoint,
                    short_rounds, kept, resume)
    finally:
        if before is not None:
            _cpus.pin(before)


def _rounds_checked(suites, rounds, short_rounds) -> int:
    """``short_rounds`` settled (:func:`ump.bench.programs.short_rounds_of`),
    once ``rounds`` and it are found fit for ``suites``."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ArgumentError(f"rounds must be an int >= 1, got {rounds!r}")
    if short_rounds is not None and (suites is None or PROGRAMS not in suites):
        raise ArgumentError("--short-rounds is for the programs suite: add --suites programs")
    try:
        return programs.short_rounds_of(rounds, short_rounds)
    except ValueError as err:
        raise ArgumentError(str(err)) from None


def _kept(report: dict, suites, configs, rounds: int, short_rounds: int, only, cpus, probe: dict) -> dict:
    """The runs of ``report``, a partial report of the programs suite, that
    a run with these arguments goes on with (``bench --resume``): the same
    configurations, rounds, short rounds, programs and CPUs, so that its
    rounds and their turning order continue where that run stopped, on a
    machine of the same kind: ``probe``, this machine's (GPUs, driver,
    CUDA, Python and the libraries' versions), as the report's.

    Raises
    ------
    ArgumentError
        Other suites than the programs suite; a finished report, or one of
        another kind of run; arguments that differ from the report's; a
        machine of another kind.
    """
    if suites is None or set(suites) != {PROGRAMS}:
        raise ArgumentError("--resume goes on with a run of the programs suite: --suites programs alone")
    if not report.get("partial"):
        raise ArgumentError("--resume: that report is not partial: its run finished, nothing is left to run")
    try:
        kept = programs.kept_runs(report["results"])
    except ValueError as err:
        raise ArgumentError(f"--resume: {err}") from None
    if not kept or len(kept) != len(report["results"]):
        raise ArgumentError("--resume: that report holds other suites' cases, or none of the programs suite")
    if "programs" not in report:
        raise ArgumentError("--resume: that report does not record which programs its run chose (a bench from "
                            "before --resume wrote it): run the programs again without --resume; --input "
                            "still prints it")
    try:
        chosen = [p.name for p in programs.select(only)]
    except ValueError as err:
        raise ArgumentError(str(err)) from None  # --only's own error
    asked = (("--configs", "configs", configs), ("--rounds", "rounds", rounds),
             ("--short-rounds", "short_rounds", short_rounds), ("programs (--only)", "programs", chosen))
    for name, key, ours in asked:
        if report.get(key) != ours:
            raise ArgumentError(f"--resume: its run had {name} {_shown(report[key])}, this one {_shown(ours)}: "
                                f"give the same")
    theirs = (report.get("cpus") or {}).get("asked")
    if theirs != cpus:
        raise ArgumentError(f"--resume: its run had --cpus {theirs or '(none)'}, this one {cpus or '(none)'}: "
                            f"give the same, as typed")
    _same_machine_kind(report.get("probe"), probe)
    return kept


def _same_machine_kind(theirs, ours: dict) -> None:
    """A resumed run's rounds are pooled with its report's: another guest
    of the same kind may go on with them, another GPU, driver or library
    version may not, as its figures are another machine's."""
    if not isinstance(theirs, dict):
        raise ArgumentError("--resume: that report does not record the machine its run was on: run the programs "
                            "again without --resume")
    ours = json.loads(json.dumps(ours))  # as a report holds it: lists, not tuples
    differ = [*_devices_differ(theirs.get("devices"), ours.get("devices") or []),
              *_fields_differ(theirs, ours, skip={"devices"})]
    if differ:
        raise ArgumentError(f"--resume: its run was on another kind of machine ({'; '.join(differ)}): its rounds "
                            f"and this machine's would be pooled as one; go on where it ran, or run the programs "
                            f"again")


def _devices_differ(theirs, ours: list) -> list:
    """What differs between two probes' GPUs, said field by field where
    both list as many; by their names otherwise."""
    if theirs == ours:
        return []
    if isinstance(theirs, list) and len(theirs) == len(ours) and all(isinstance(d, dict) for d in theirs):
        return [line for i, (a, b) in enumerate(zip(theirs, ours)) for line in _fields_differ(a, b, f"GPU {i} ")]

    def names(devices):
        if not isinstance(devices, list):
            return str(devices)
        return ", ".join(str(d.get("name") if isinstance(d, dict) else d) for d in devices) or "no GPU"

    return [f"GPUs {names(theirs)}, here {names(ours)}"]


def _fields_differ(theirs: dict, ours: dict, label: str = "", skip=frozenset()) -> list:
    """Each field of two mappings whose values differ, said as "field
    theirs, here ours" after ``label``; the fields in ``skip`` left out."""
    return [f"{label}{key} {_shown(theirs.get(key))}, here {_shown(ours.get(key))}"
            for key in sorted({*theirs, *ours} - set(skip)) if theirs.get(key) != ours.get(key)]


def _shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _pin(spec: str, progress) -> tuple[dict, set]:
    """Pin this process, and so every process the run starts, to the CPUs
    ``spec`` names (:mod:`ump.bench.cpus`): (what the report keeps, the CPUs
    the process had)."""
    try:
        usable = _cpus.allowed()
        chosen = _cpus.parse(spec, usable)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    _cpus.pin(chosen)
    print(f"every process runs on CPU {_cpus.ranges(chosen)}", file=progress, flush=True)
    return {"asked": spec, "used": chosen}, set(usable)


def _run(suites, smoke, configs, rounds, progress, caps, found, selected, pinned, checkpoint,
         short_rounds: int, kept=None, resumed=None) -> dict:
    """The run itself, its arguments checked and ``short_rounds`` settled
    (:func:`run`); ``kept``: the runs of ``resumed``, the partial report it
    goes on with (:func:`_kept`)."""
    raw, skipped, processes = {}, {}, []
    # when each partial report this run goes on with was written
    earlier = [] if resumed is None else [*resumed.get("resumed", []), str(resumed.get("time", "?"))]

    cache, warm = None, False
    if found is not None:
        # warm: the partial report this run goes on with was written where CuPy's kernels are compiled already
        cache = programs.kernel_cache()
        warm = resumed is not None and programs.warmed_by(resumed, cache)
        cache["mark"] = resumed["kernel_cache"]["mark"] if warm else programs.mark_cache(cache)

    def report_of(results, skipped_cases):
        extra = ({"short_rounds": short_rounds, "programs": [p.name for p in selected], "kernel_cache": cache}
                 if found is not None else {})
        if earlier:
            extra["resumed"] = earlier
        return {"probe": caps.as_dict(), "configs": configs, "smoke": smoke, "rounds": rounds, **extra,
                "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results, "skipped": skipped_cases,
                "processes": processes, "cpus": pinned}

    def save(results, skipped_cases):
        """The checkpoint's report, which the run goes on without changing:
        ``results``' entries come fresh from :func:`summarised` (the
        worker suites' are done with once the programs run)."""
        checkpoint({**report_of(dict(results), dict(skipped_cases)), "processes": list(processes),
                    "partial": True})

    t_start = time.perf_counter()
    steps = [(r, c) for r in range(rounds) for c in configs] if suites else []
    shown = _progress.Progress([(c, s) for _, c in steps for s in _progress.suites_in(c, suites, CONFIG_FREE)],
                               progress)
    for i, (r, config) in enumerate(steps, 1):
        shown.say(f"[{i}/{len(steps)}] round {r + 1}/{rounds} {config}: {', '.join(suites)} "
                  f"({time.perf_counter() - t_start:.0f} s so far)")
        proc = _progress.run_worker(_worker(config, suites, smoke), config, shown, env=dict(os.environ))
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark configuration {config!r} failed:\n{proc.stderr[-4000:]}")
        timings = json.loads(proc.stdout)
        process = timings.pop(PROCESS_KEY)
        if config == "stock" and process["ump_imported"]:
            raise RuntimeError("the stock configuration's process imported ump")
        processes.append({"round": r + 1, "config": config, "cpus": process.get("cpus")})
        _record(raw, skipped, timings, config, progress)
        if checkpoint is not None and raw:
            save(summarised(raw), skipped)
    shown.close()
    results = summarised(raw)
    if found is not None:
        if kept:
            n = sum(len(e["round_cpu"]) for per in kept.values() for c, e in per.items() if c != "suite")
            print(f"going on with the partial report written at {earlier[-1]}: its {n} runs kept",
                  file=progress, flush=True)
        if warm:
            print("it was written in this boot of the machine, whose kernel cache its run warmed: no warm-ups",
                  file=progress, flush=True)
        try:
            ran, not_run = programs.run(
                [c for c in configs if c != "imported"], rounds, found, short_rounds=short_rounds,
                warmup=0 if warm else 1, gpus=len(caps.devices), programs=selected,
                progress=progress, kept=kept,
                checkpoint=None if checkpoint is None else lambda r, n: save({**results, **r}, {**skipped, **n}))
        except programs.CannotResume as err:  # raised before anything runs
            raise ArgumentError(f"--resume: {err}") from None
        results.update(ran)
        skipped.update(not_run)
    return report_of(results, skipped)


def overhead(report, cases=("add 100x100", "divide 100x100", "divmod 100x100")) -> list[str]:
    """CPU-time overhead of ump on dispatch: the ratio of medians against
    stock with its range over rounds, and the difference in microseconds."""
    lines = []
    for case in cases:
        per = report["results"].get(case)
        if not per or "stock" not in per:
            continue
        base = per["stock"]
        for config in report["configs"]:
            if config == "stock" or config not in per:
                continue
            e = per[config]
            ratio = e["cpu"]["median"] / base["cpu"]["median"]
            pairs = round_ratios(e, base, "cpu")
            spread = f", rounds {min(pairs):.3f}–{max(pairs):.3f}" if len(pairs) > 1 else ""
            delta = e["cpu"]["median"] - base["cpu"]["median"]
            lines.append(f"{case} [{config}]: CPU ×{ratio:.3f}{spread}; {delta:+.2f} µs per call")
    return lines


def _judged_by(entry, base) -> str:
    """"gpu" where both configurations' figures are their GPU time
    (:func:`_time_of`), else "cpu": a ratio and its rounds on one figure."""
    return "gpu" if all(e.get("gpu") and _time_of(e) is e["gpu"] for e in (entry, base)) else "cpu"


def _time_of(entry):
    """The figure a case is judged by: GPU time where the GPU did the work."""
    gpu = entry.get("gpu")
    return gpu if gpu and gpu["median"] > entry["cpu"]["median"] * 0.5 else entry["cpu"]


def table(report) -> str:
    configs = report["configs"]
    head = "| case | " + " | ".join(configs) + " |"
    lines = [head, "|" + "---|" * (len(configs) + 1)]
    for case, per in report["results"].items():
        base = per.get("stock")
        cells = []
        for config in configs:
            entry = per.get(config)
            if entry is None:
                cells.append("")
                continue
            cpu = entry["cpu"]
            gpu = entry["gpu"]
            if cpu is None:  # a program that failed in every round
                cells.append(f"no run exited 0 (exit {entry.get('returncodes')})")
                continue
            text = f"CPU {cpu['median']:.1f} µs"
            if gpu:
                text += f", GPU {gpu['median']:.1f} µs"
            for name, values in entry.get("metrics", {}).items():
                text += f"; {name} {statistics.median(values):.3g}"
            if base and base["cpu"] and config != "stock":
                key = _judged_by(entry, base)
                ratio = entry[key]["median"] / base[key]["median"]
                pairs = round_ratios(entry, base, key)
                spread = f"; rounds {min(pairs):.2f}–{max(pairs):.2f}" if len(pairs) > 1 else ""
                text += f" (×{ratio:.3g}{spread})"
            cells.append(text)
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare(old, new, threshold=1.25, floor_us=1.0) -> list[str]:
    """Slow-downs of ``new`` against ``old``: a median at least ``threshold``
    times the old one whose interquartile range lies wholly above the old
    one's (so noise alone does not flag), for cases over ``floor_us``."""
    found = []
    for case, per in new["results"].items():
        for config, entry in per.items():
            if config == "suite":
                continue
            before = old["results"].get(case, {}).get(config)
            if not before or not before["cpu"]:
                continue
            if not entry["cpu"]:  # it ran to the end before, and fails now
                found.append(f"{case} [{config}]: no run exited 0 (exit {entry.get('returncodes')})")
                continue
            a, b = _time_of(before), _time_of(entry)
            if a["median"] < floor_us:
                continue
            if b["median"] >= threshold * a["median"] and b["q1"] > a["q3"]:
                found.append(f"{case} [{config}]: {a['median']:.1f} -> {b['median']:.1f} µs "
                             f"(×{b['median'] / a['median']:.2f})")
    return found


#: The interop suite's operations, a panel each in the plot.
INTEROP_OPS = ("asarray", "asnumpy", "roundtrip")


def plot(report, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ops = [op for op in INTEROP_OPS if any(case.startswith(op + " ") for case in report["results"])]
    # One panel per operation: every configuration's line of one operation
    # side by side, each in its own colour.
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for config in report["configs"]:
            xs, ys = [], []
            for case, per in report["results"].items():
                if case.startswith(op + " ") and config in per:
                    xs.append(int(case.split()[1].removesuffix("MiB")))
                    ys.append(_time_of(per[config])["median"])
            if xs:
                ax.plot(xs, ys, marker="o", label=config)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("array size (MiB)")
        ax.set_title(op)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("time (µs, median)")
    fig.suptitle("NumPy ↔ CuPy conversion time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _load(option: str, path: str) -> dict:
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ArgumentError(f"{option}: file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ArgumentError(f"{option}: cannot read {path}: {err}") from None
    except json.JSONDecodeError as err:
        raise ArgumentError(f"{option}: {path} is not JSON: {err}") from None
    if (not isinstance(report, dict) or not isinstance(report.get("results"), dict)
            or not isinstance(report.get("configs"), list)):
        raise ArgumentError(f"{option}: {path} is not a bench report (it needs 'results' and 'configs')")
    return report


def partial_path(output: str) -> str:
    """Where a run writes the report of what has finished while it runs:
    beside ``output`` (``bench.json``: ``bench.partial.json``), so that
    ``output``, the last finished run's report (and ``--compare``'s file,
    often), stays whole until the run ends."""
    root, ext = os.path.splitext(output)
    return f"{root}.partial{ext or '.json'}"


def _write_report(path: str, report: dict) -> None:
    """Write ``report`` to ``path`` whole or not at all: into a file beside
    it, then renamed over it, so a run killed while it writes leaves the
    file before."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = f"{path}.part"
    try:
        with open(part, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(part, path)
    except BaseException:
        try:
            os.unlink(part)
        except OSError:
            pass
        raise


class _Checkpoints:
    """The bench command's checkpoint (:func:`run`): each partial report to
    :func:`partial_path` of the output. One it cannot write (disk full) is
    said once on stderr and no more are written: they exist to keep a run's
    figures, never to stop it."""

    def __init__(self, output: str):
        self.path = partial_path(output)
        self.written = self.failed = False

    def start(self) -> None:
        """Before the run: an earlier run's partial report would pass for
        this one's until the first checkpoint, and outlive it if none is
        written."""
        if os.path.exists(self.path):
            print(f"bench: removing {self.path}, an earlier run's partial report", file=sys.stderr)
            self._remove()

    def __call__(self, report: dict) -> None:
        if self.failed:
            return
        try:
            _write_report(self.path, report)
            self.written = True
        except OSError as err:
            self.failed = True
            print(f"bench: cannot write {self.path} ({err.strerror or err}); the run goes on, "
                  f"no more partial reports are written", file=sys.stderr, flush=True)

    def say_where(self) -> None:
        """For a run that stops: where what it measured is."""
        if self.written:
            print(f"bench: what had finished is in {self.path}", file=sys.stderr)

    def done(self) -> None:
        """The whole report is written: the partial one goes."""
        self._remove()

    def _remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as err:
            print(f"bench: cannot remove {self.path} ({err.strerror or err})", file=sys.stderr)


def _print_tables(report: dict) -> None:
    """What a run prints: the cases' table, the programs' table and the
    overhead on dispatch; first, for a partial report, that it is one."""
    if report.get("partial"):
        print("A partial report, written before its run ended (stopped, or still running): "
              "what had finished.\n")
    if report.get("resumed"):
        print(f"A run that went on with the runs of the partial report written at "
              f"{', then '.join(report['resumed'])}: their rounds and this run's are not told apart below.\n")
    print(table(report))
    text = programs.table(report)
    if text:
        print("\nPrograms (wall time and the GPU time each program prints, against stock):")
        print(text)
    lines = overhead(report)
    if lines:
        print("\nOverhead on dispatch (CPU time):")
        print("\n".join(lines))


def _say_if_partial(path: str, report: dict) -> None:
    """For ``--compare``: a report of a run cut short lacks cases."""
    if report.get("partial"):
        print(f"bench: {path} is a partial report: its cases that did not run are not compared",
              file=sys.stderr)


def _has_interop_cases(report) -> bool:
    return any(case.split()[0] in INTEROP_OPS for case in report["results"])


def main(args) -> int:
    """``python -m ump bench``. Bad arguments raise :class:`ArgumentError`
    before anything runs or is written. While the run goes on, what has
    finished is written to :func:`partial_path` of ``--output``, which the
    finished report replaces. ``--input`` without ``--compare`` prints a
    saved report's tables (a partial one included)."""
    old = _load("--compare", args.compare) if args.compare else None  # before a long run, not after
    if old is not None:
        _say_if_partial(args.compare, old)
    if args.input:
        report = _load("--input", args.input)
        if not args.compare:
            _print_tables(report)
            return 0
    else:
        checkpoint = _Checkpoints(args.output)
        if args.compare and os.path.abspath(args.compare) == os.path.abspath(checkpoint.path):
            raise ArgumentError(f"--compare {args.compare}: this run writes its partial reports there; "
                                f"copy it elsewhere first")
        resume = getattr(args, "resume", None)
        resumed = _load("--resume", resume) if resume else None
        suites = args.suites.split(",") if args.suites else None
        configs = args.configs.split(",") if args.configs else None
        if resumed is None or os.path.abspath(resume) != os.path.abspath(checkpoint.path):
            checkpoint.start()  # a run going on with its own partial report rewrites it, kept runs and all
        try:
            report = run(suites=suites, smoke=args.smoke, configs=configs, rounds=args.rounds,
                         short_rounds=getattr(args, "short_rounds", None),
                         programs_dir=getattr(args, "programs", None), cpus=getattr(args, "cpus", None),
                         only=args.only.split(",") if getattr(args, "only", None) is not None else None,
                         checkpoint=checkpoint, resume=resumed)
        except BaseException:
            checkpoint.say_where()
            raise
        if not report["results"]:
            # keep what an earlier run wrote rather than replace it with nothing
            print(f"bench: the run produced no results; {args.output} not written", file=sys.stderr)
            return 1
        try:
            _write_report(args.output, report)
        except OSError as err:
            print(f"bench: cannot write {args.output} ({err.strerror or err})", file=sys.stderr)
            checkpoint.say_where()
            _print_tables(report)
            return 1
        checkpoint.done()
        _print_tables(report)
        print(f"\nJSON: {args.output}")
        if args.plot:
            if not _has_interop_cases(report):
                print(f"plot not written ({args.plot}): no interop cases in this run (they need a GPU)",
                      file=sys.stderr)
            else:
                os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
                if plot(report, args.plot):
                    print(f"plot: {args.plot}")
                else:
                    print(f"plot not written ({args.plot}): matplotlib is not installed "
                          f"({pip_install('bench')})", file=sys.stderr)
    if args.compare:
        if args.input:
            _say_if_partial(args.input, report)
        slow = compare(old, report, threshold=args.threshold)
        for line in slow:
            print(f"SLOWER: {line}")
        if slow:
            return 1
        print("no slow-down found")
    return 0
