"""The ``programs`` suite: programs nobody in this project wrote, run
unedited, each under stock ``python`` and under ``python -m ump run``.

The programs come from three sources (:data:`SOURCES`):

- CuPy's own examples (tag v14.2.0), from a checkout of CuPy's source;
- the examples in the docstrings of the installed CuPy's ``cupyx.scipy``,
  each docstring's code in order, as doctest would run it, written to a
  script (their expected output is not compared);
- PyLops (2.5.0, installed), a published solver library, through its own
  tests run on CuPy as its documentation says (``TEST_CUPY_PYLOPS=1``),
  from a checkout of its source.

``UMP_BENCH_PROGRAMS`` (or ``bench --programs``, once per folder) names the
folders: CuPy's ``examples/`` and PyLops's checkout (whose test settings
apply), told apart by the files they hold; a source not named is skipped
with the reason. Each run is a process of its own; what is recorded is the
process's wall time and the GPU time the program prints itself, where it
prints one. A first round, under the first configuration, warms CuPy's
kernel cache and is not recorded (none where a run goes on with a partial
report written in this boot of the machine: :func:`warmed_by`); then every
round runs every program under every configuration, the order of the
configurations turning from round to round so that slow drift of the
machine spreads over all of them. The programs that stock runs in under
:data:`SHORT_S` seconds go on for more rounds than the others (``bench
--short-rounds``): there the spread from one process to the next is as wide
as the bound the suite holds ump to, and a cost paid once per process weighs
most.
"""

from __future__ import annotations

import ast
import collections
import copy
import dataclasses
import doctest
import importlib.util
import math
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

from .summary import round_pairs, round_ratios, summarised

__all__ = ["PROGRAMS", "SOURCES", "ENV", "CannotResume", "Program", "Source", "command", "docstring_script",
           "folders", "kept_runs", "kernel_cache", "mark_cache", "run", "short_rounds_of", "table", "warmed_by"]

#: The variable that names the programs' folders (``os.pathsep`` between them).
ENV = "UMP_BENCH_PROGRAMS"
_GPU_SECONDS = r"GPU[^:\n]*:\s*([0-9.]+) sec"  # ' GPU :  1.23 sec', 'GPU (CuPy, ...):\t1.2 sec'


@dataclasses.dataclass(frozen=True)
class Source:
    """Where programs come from."""
    name: str
    marker: str | None  # a file its folder holds; None: the installed CuPy is the source
    how: str            # how to get the folder


#: The sources, by name.
SOURCES = {s.name: s for s in (
    Source("cupy", "cg/cg.py", "git clone --depth 1 --branch v14.2.0 https://github.com/cupy/cupy, "
                               "then name cupy/examples"),
    Source("pylops", "pytests/test_leastsquares.py",
           "pip install pylops==2.5.0; git clone --depth 1 --branch v2.5.0 https://github.com/PyLops/pylops, "
           "then name pylops"),
    Source("cupyx-docs", None, "the installed CuPy"),
)}


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    path: str                   # under its source's folder; for cupyx-docs FILE:NAME under cupyx's parent
    args: tuple = ()
    gpu_time: str | None = None  # a regex: group 1 of every match, summed, times `unit`, is its GPU time
    unit: float = 1.0            # seconds per printed unit
    needs: tuple = ()            # modules it imports beyond NumPy and CuPy
    gpus: int = 1
    source: str = "cupy"
    module: str | None = None    # run as ``python -m MODULE path args`` (a test runner)
    env: tuple = ()              # (NAME, VALUE) pairs its source's documentation says to set


#: The docstrings of cupyx.scipy (v14.2.0) whose examples run under stock
#: CuPy: (name, FILE:NAME under cupyx/scipy). The others do not: names
#: undefined in them (``cupy`` after ``import cupy as cp``, ``cusignal``),
#: continuation lines the doctest markup lost, a NumPy conversion of a CuPy
#: array that stock CuPy refuses, arguments the documented method refuses
#: (KDTree's lists and tuples), modules not installed (cuCIM).
_DOCS = (
    ("signal.argrelmin", "signal/_peak_finding.py:argrelmin"),
    ("signal.argrelmax", "signal/_peak_finding.py:argrelmax"),
    ("signal.argrelextrema", "signal/_peak_finding.py:argrelextrema"),
    ("signal.unit_impulse", "signal/_waveforms.py:unit_impulse"),
    ("interpolate.interpn", "interpolate/_rgi.py:interpn"),
    ("interpolate.RegularGridInterpolator", "interpolate/_rgi.py:RegularGridInterpolator.__call__"),
    ("stats.trim_mean", "stats/_stats.py:trim_mean"),
    ("ndimage.value_indices", "ndimage/_measurements.py:value_indices"),
)
#: PyLops's test modules of its solvers and the operators they use, run on
#: CuPy (all pass under stock CuPy).
_PYLOPS = ("leastsquares", "solver", "basicoperators", "linearoperator")

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
    *(Program(f"cupyx.scipy {name}", f"cupyx/scipy/{path}", source="cupyx-docs") for name, path in _DOCS),
    *(Program(f"pylops {name}", f"pytests/test_{name}.py",
              ("-q", "-p", "no:cacheprovider", "-p", "no:ump.pytest_plugin"),  # its settings, not ump's plugin
              needs=("pylops", "pytest", "scipy"), source="pylops", module="pytest",
              env=(("TEST_CUPY_PYLOPS", "1"),))
      for name in _PYLOPS),
)


def folders(paths=None) -> dict:
    """The programs' folders by source: ``paths`` (a list, or one string
    with ``os.pathsep`` between folders), else ``UMP_BENCH_PROGRAMS``. Each
    folder is the source whose marker file it holds.

    Raises
    ------
    ValueError
        No folder is named, or one holds none of the sources' markers.
    """
    if paths is None:
        paths = os.environ.get(ENV, "")
    if isinstance(paths, str):
        paths = paths.split(os.pathsep)
    paths = [p for p in paths if p]
    cupy = SOURCES["cupy"]
    if not paths:
        raise ValueError(f"the programs suite runs CuPy's examples: {cupy.how} "
                         f"({ENV}=cupy/examples, or bench --programs cupy/examples)")
    found = {}
    for path in paths:
        for source in SOURCES.values():
            if source.marker and os.path.isfile(os.path.join(path, source.marker)):
                found[source.name] = os.path.abspath(path)
                break
        else:
            markers = ", ".join(f"{s.marker} ({s.name})" for s in SOURCES.values() if s.marker)
            raise ValueError(f"{path} holds no programs the suite knows: none of {markers} is there; "
                             f"CuPy's examples: {cupy.how}")
    return found


def select(names, programs=PROGRAMS) -> tuple:
    """The programs named in ``names`` (``bench --only``): a name selects the
    program of that name and those whose name starts with it and a space
    (``stream`` selects ``stream cupy_event`` and the other stream examples).
    None: all of them.

    Raises
    ------
    ValueError
        A name that selects no program, with the names there are.
    """
    if names is None:
        return tuple(programs)
    chosen = []
    for name in names:
        hits = [p for p in programs if p.name == name or p.name.startswith(name + " ")]
        if not hits:
            raise ValueError(f"no program of the programs suite is named {name!r}: "
                             + ", ".join(p.name for p in programs))
        chosen += [p for p in hits if p not in chosen]
    return tuple(p for p in programs if p in chosen)  # the suite's order


#: The bound the suite holds a program's time under ump to, against stock's:
#: its ratio of medians, or one round's ratio (within the spread of its rounds).
WITHIN = 1.05

#: Programs whose stock wall time is under this many seconds are where a cost
#: ump pays once per process (its start-up, its exit) weighs: the table gives
#: their time against stock's pair by pair, in milliseconds, and they run
#: ``short_rounds`` rounds (:func:`run`).
SHORT_S = 2.5


def command(config: str, script: str, args=(), module: str | None = None) -> list[str]:
    """The command line that runs ``script`` (or ``-m module script``) under
    ``config``: ``stock`` is plain Python, which never imports ump; ``auto``
    is ``python -m ump run`` with nothing else; ``BACKEND[:PLACEMENT]``
    names them."""
    target = [script, *args] if module is None else ["-m", module, script, *args]
    if config == "stock":
        return [sys.executable, *target]
    backend, _, placement = config.partition(":")
    options = [] if backend == "auto" else ["--backend", backend]
    if placement:
        options += ["--placement", placement]
    return [sys.executable, "-m", "ump", "run", *options, *target]


def without_ump_settings(environ=os.environ) -> dict:
    """``environ`` without ump's settings (``UMP_*``, ``CUPY_ENABLE_UMP``):
    each configuration says all it sets on its command line, so a variable
    left in the shell cannot turn ``auto`` into another backend."""
    return {k: v for k, v in environ.items() if not k.startswith("UMP_") and k != "CUPY_ENABLE_UMP"}


def _environment(program: Program) -> dict:
    """The caller's environment without ump's settings, with what the
    program's source says to set."""
    env = without_ump_settings()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(program.env)
    return env


def _cupyx_root() -> str:
    """The folder that holds the installed ``cupyx`` (found, not imported).

    Raises
    ------
    ValueError
        CuPy is not installed.
    """
    spec = importlib.util.find_spec("cupyx")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("cupyx is not installed")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def docstring_script(target: str, folder: str) -> str:
    """Write the examples of one docstring of the installed CuPy to a script
    in ``folder``, in order, each as doctest would run it (the expected
    output is not compared); its path. ``target`` is ``FILE:NAME`` (or
    ``FILE:CLASS.NAME``), FILE under the folder that holds ``cupyx``. The
    file is parsed, not imported.

    Raises
    ------
    ValueError
        CuPy is not installed, or the file or the docstring is not there, or
        the docstring has no examples.
    """
    file, _, qualname = target.partition(":")
    path = os.path.join(_cupyx_root(), file)
    try:
        with open(path, encoding="utf-8") as f:
            body = ast.parse(f.read()).body
    except (FileNotFoundError, NotADirectoryError) as err:
        raise ValueError(f"this CuPy has no {file}: {err.strerror}") from err
    node = None
    for name in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            raise ValueError(f"{path} defines no {qualname}")
        body = node.body
    examples = doctest.DocTestParser().get_examples(ast.get_docstring(node) or "")
    if not examples:
        raise ValueError(f"the docstring of {qualname} in {path} has no examples")
    script = os.path.join(folder, "doc_" + re.sub(r"\W", "_", target) + ".py")
    with open(script, "w", encoding="utf-8") as f:
        f.write("".join(e.source for e in examples))
    return script


def _missing(program: Program, gpus: int, found: dict) -> str | None:
    source = SOURCES[program.source]
    if source.marker and program.source not in found:
        return f"no folder of {source.name}'s programs was named ({source.how})"
    for module in program.needs:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    if program.gpus > gpus:
        return f"needs {program.gpus} GPU{'s' * (program.gpus > 1)}, this machine has {gpus}"
    return None


def _once(program: Program, config: str, script: str, cwd: str, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run(command(config, script, program.args, program.module), cwd=cwd,
                              env=_environment(program), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"wall": None, "gpu": None, "rc": None, "error": f"ran past {timeout:.0f} s"}
    wall = time.perf_counter() - start
    gpu = None
    if program.gpu_time is not None:
        found = [float(x) for x in re.findall(program.gpu_time, proc.stdout)]
        gpu = sum(found) * program.unit if found else None
    out = {"wall": wall, "gpu": gpu, "rc": proc.returncode}
    if proc.returncode != 0:
        # A test runner says what failed on stdout, a script on stderr.
        out["error"] = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no message)"]
    return out


class CannotResume(ValueError):
    """A run cannot go on with the runs a report kept (``bench --resume``)."""


#: The lists of one program's entry under one configuration, a run added to
#: each (:func:`_record`).
_RUN_LISTS = ("cpu_times", "gpu_times", "round_cpu", "round_gpu", "returncodes", "errors")


def _record(results: dict, program: Program, config: str, one: dict) -> None:
    """Add one recorded run to ``results``. A run that failed counts for
    nothing (a crash is quick); its round keeps its place, as None, so
    rounds pair up."""
    entry = results.setdefault(f"program {program.name}", {"suite": "programs"}).setdefault(
        config, {**{name: [] for name in _RUN_LISTS}, "metrics": {}})
    entry["returncodes"].append(one["rc"])
    if "error" in one:
        entry["errors"].append(one["error"])
    for key, times, rounds in (("wall", "cpu_times", "round_cpu"), ("gpu", "gpu_times", "round_gpu")):
        value = one[key] * 1e6 if one["rc"] == 0 and one[key] is not None else None
        entry[rounds].append(value)
        if value is not None:
            entry[times].append(value)


def short_rounds_of(rounds: int, short_rounds: int | None = None) -> int:
    """The rounds of the programs under :data:`SHORT_S`: ``short_rounds``,
    or twice ``rounds`` where it is None.

    Raises
    ------
    ValueError
        ``short_rounds`` is not an int at least ``rounds``.
    """
    value = 2 * rounds if short_rounds is None else short_rounds
    if isinstance(value, bool) or not isinstance(value, int) or value < rounds:
        raise ValueError(f"--short-rounds must be at least --rounds ({rounds}), got {value!r}")
    return value


def kept_runs(results: dict) -> dict:
    """The recorded runs of the programs in a report's ``results`` (a run
    cut short: ``bench --resume``), as :func:`run` goes on with them: its
    programs' entries without their summaries, which :func:`run` makes
    anew, sharing their lists with ``results`` (:func:`run` copies them).

    Raises
    ------
    ValueError
        An entry lacks one of the lists a run is recorded in.
    """
    out = {}
    for case, per in results.items():
        if not isinstance(per, dict) or per.get("suite") != "programs":
            continue
        out[case] = {"suite": "programs"}
        for config, entry in per.items():
            if config == "suite":
                continue
            if not isinstance(entry, dict) or not all(isinstance(entry.get(k), list) for k in _RUN_LISTS):
                raise ValueError(f"its entry of {case!r} under {config!r} lacks the runs' lists "
                                 f"({', '.join(_RUN_LISTS)})")
            out[case][config] = {k: v for k, v in entry.items() if k not in ("cpu", "gpu")}  # run() copies
    return out


def _recorded(results: dict, program: Program, config: str) -> int:
    """How many rounds of ``program`` under ``config`` ``results`` holds."""
    return len(results.get(f"program {program.name}", {}).get(config, {}).get("round_cpu", ()))


def run(configs, rounds: int, found: dict, *, short_rounds: int | None = None, warmup: int = 1, gpus: int = 1,
        timeout: float = 600, programs=PROGRAMS, progress=sys.stderr, checkpoint=None,
        kept=None) -> tuple[dict, dict]:
    """(results, skipped): per program and configuration, the wall and
    printed GPU times of ``rounds`` runs (microseconds, as the other suites),
    after ``warmup`` rounds that are not recorded; a program that stock
    (the first configuration where there is no stock) ran in under
    :data:`SHORT_S` seconds, by its median over those rounds, goes on to
    :func:`short_rounds_of` ``(rounds, short_rounds)`` rounds.
    ``found``: the folders by source (:func:`folders`).
    ``checkpoint(results, skipped)``, if given, is called after each
    recorded run (the warm-up's are not) with copies of what has finished
    so far, summarised as at the end: a run of many minutes that is cut
    short keeps its table. ``kept`` (:func:`kept_runs`): the runs of such a
    run with the same configurations and rounds; a round it holds is not
    run again, and a program with nothing left is not warmed up.

    Raises
    ------
    ValueError
        ``short_rounds`` below ``rounds``.
    CannotResume
        A program with runs left in ``kept`` that this machine cannot run.
    """
    short_rounds = short_rounds_of(rounds, short_rounds)
    judge = "stock" if "stock" in configs else configs[0]
    found = {name: os.path.abspath(path) for name, path in found.items()}  # the programs run elsewhere
    skipped, results = {}, copy.deepcopy(kept or {})

    def short(program) -> bool:
        return _short(results.get(f"program {program.name}", {}).get(judge), rounds)

    def known_short(program) -> bool:
        """The first rounds it is judged by are kept, and found it short."""
        return _recorded(results, program, judge) >= rounds and short(program)

    def left(program) -> int:
        """Its runs still to make in the first rounds, and in the short
        programs' rounds where it is known to be short."""
        total = short_rounds if known_short(program) else rounds
        return sum(max(0, total - _recorded(results, program, c)) for c in configs)

    with tempfile.TemporaryDirectory() as cwd:
        scripts = {}  # the programs this machine runs, and the file each runs
        for program in programs:
            why = _script(program, gpus, found, cwd, scripts)
            if why is None:
                continue
            if f"program {program.name}" in results:
                if left(program):
                    raise CannotResume(f"{program.name} has runs left in the report this run goes on with, "
                                       f"and cannot run here: {why}")
                continue  # its kept runs are all it makes
            skipped[f"program {program.name}"] = why
            print(f"program skipped ({program.name}): {why}", file=progress, flush=True)
        chosen = list(scripts)
        warm = [p for p in chosen if left(p)]  # warming CuPy's kernel cache takes one run of each program
        plan = _Plan({p: left(p) + (warmup if p in warm else 0) for p in chosen},
                     {p: 0 if _recorded(results, p, judge) >= rounds else (short_rounds - rounds) * len(configs)
                      for p in chosen}, progress)
        for r in range(warmup + short_rounds):
            k = r - warmup + 1  # the round, from 1; the configurations' order turns with it
            order = configs[:1] if r < warmup else configs[k % len(configs):] + configs[:k % len(configs)]
            if r == warmup + rounds:
                chosen = [p for p in chosen if short(p)]
                plan.extend(chosen)
            label = "warm-up" if r < warmup else f"round {k}/{rounds if k <= rounds else short_rounds}"
            for program in warm if r < warmup else chosen:
                for config in order:
                    if r >= warmup and _recorded(results, program, config) >= k:
                        continue  # kept from the run this one goes on with
                    plan.say(label, program, config)
                    one = _once(program, config, scripts[program], cwd, timeout)
                    plan.ran(program, one, guess=r < warmup)
                    if r >= warmup:
                        _record(results, program, config, one)
                        if checkpoint is not None:
                            checkpoint(summarised(results), dict(skipped))
    return summarised(results), skipped


def _script(program: Program, gpus: int, found: dict, cwd: str, scripts: dict) -> str | None:
    """Put the file ``program`` runs in ``scripts`` (a docstring's examples
    written to a script in ``cwd``); or why this machine cannot run it."""
    why = _missing(program, gpus, found)
    if why is None:
        try:
            scripts[program] = (docstring_script(program.path, cwd) if program.source == "cupyx-docs"
                                else os.path.join(found[program.source], program.path))
        except (OSError, SyntaxError, ValueError) as err:
            why = str(err)
    return why


#: Linux's name for this boot of the machine, new at each start.
_BOOT_ID = "/proc/sys/kernel/random/boot_id"

#: The file a run of the programs suite leaves in CuPy's kernel cache
#: folder, with its token: the cache it warmed is still that folder's.
_MARK = "ump-bench-warmed."


def kernel_cache() -> dict:
    """Where the programs' runs compile CuPy's kernels: this boot of the
    machine (None where the system does not name it) and the folder of
    CuPy's kernel cache (``CUPY_CACHE_DIR``, else CuPy's default; None for
    a relative or empty ``CUPY_CACHE_DIR``, which each program's own
    working folder, made for the run, would resolve). A report of the
    programs suite records it with the token of its mark
    (:func:`mark_cache`, :func:`warmed_by`)."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip() or None
    except OSError:
        boot = None
    folder = os.environ.get("CUPY_CACHE_DIR")
    if folder is None:
        folder = os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    return {"boot": boot, "folder": folder if os.path.isabs(folder) else None}


def mark_cache(cache: dict) -> str | None:
    """Leave a mark with a new token in ``cache``'s folder, which the run's
    warm-ups are about to fill; the token, or None where there is no
    folder to mark or it cannot be written."""
    if cache["folder"] is None:
        return None
    token = secrets.token_hex(8)
    try:
        os.makedirs(cache["folder"], exist_ok=True)
        with open(os.path.join(cache["folder"], _MARK + token), "x"):
            pass
    except OSError:
        return None
    return token


def warmed_by(report: dict, here: dict) -> bool:
    """Whether the run that wrote ``report``, a partial report of the
    programs suite, left CuPy's kernel cache warm ``here`` (this run's
    :func:`kernel_cache`) for every program it
    had runs left of: it ran in this boot of the machine, with the same
    cache folder, and its mark is still there (a folder emptied, or another
    machine's container of the same host, which shares the boot, has
    none). Its warm-ups compiled those programs' kernels into that folder
    before it recorded a run (or, where it went on with such a report
    itself, the warm-ups of the run before did), so a run going on with it
    needs none: a resumed call on the machine that stopped spends no
    minutes warming up again."""
    theirs = report.get("kernel_cache") or {}
    mark = theirs.get("mark")
    return (here["boot"] is not None and here["folder"] is not None and isinstance(mark, str)
            and theirs.get("boot") == here["boot"] and theirs.get("folder") == here["folder"]
            and os.path.isfile(os.path.join(here["folder"], _MARK + mark)))


class _Plan:
    """The runs each program has still to make, said as the run goes on
    with the time left, from each program's own time per run (cg's is 25
    times a one-second program's). A program makes ``runs[program]`` runs,
    and ``extra[program]`` more where it is short: guessed from its warm-up
    (which compiles kernels, so may take longer), settled after its first
    rounds (:meth:`extend`)."""

    def __init__(self, runs: dict, extra: dict, progress):
        programs = list(runs)
        self.left = dict(runs)
        self.extra, self.guessed = extra, dict.fromkeys(programs, 0)
        self.spent = {p: [0.0, 0] for p in programs}  # seconds, runs
        self.done, self.t0, self.progress = 0, time.perf_counter(), progress

    def extend(self, short) -> None:
        """The first rounds are over: the ``short`` programs go on."""
        for program in self.left:
            self.left[program] += self.extra[program] if program in short else 0
            self.guessed[program] = 0

    def say(self, label: str, program, config: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        seconds, runs = map(sum, zip(*self.spent.values()))
        per_run = {p: s / n if n else (seconds / runs if runs else math.nan) for p, (s, n) in self.spent.items()}
        left = sum((self.left[p] + self.guessed[p]) * per_run[p] for p in self.left)
        total = self.done - 1 + sum(self.left.values()) + sum(self.guessed.values())
        print(f"[{self.done}/{total}] {label} {program.name} [{config}] "
              f"({elapsed:.0f} s so far, ~{left:.0f} s left)", file=self.progress, flush=True)

    def ran(self, program, one: dict, guess: bool) -> None:
        """``one`` (:func:`_once`) ran; a warm-up run guesses whether its
        program is short."""
        self.left[program] -= 1
        if one["wall"] is not None:
            self.spent[program][0] += one["wall"]
            self.spent[program][1] += 1
        if guess:
            self.guessed[program] = self.extra[program] if one["wall"] is not None and one["wall"] < SHORT_S else 0
        gpu = "" if one["gpu"] is None else f", GPU {one['gpu']:.3f} s"
        wall = "" if one["wall"] is None else f"{one['wall']:.2f} s"
        print(f"    {wall}{gpu}, exit {one['rc']}{': ' + str(one['error']) if 'error' in one else ''}",
              file=self.progress, flush=True)


def _short(entry, rounds: int) -> bool:
    """Whether the first ``rounds`` rounds of ``entry`` (one program, one
    configuration) took under :data:`SHORT_S` seconds of wall time by their
    median: those a run judges by, whether or not more rounds are kept
    (``bench --resume``). A program none of whose runs exited 0 is not
    short."""
    times = [t for t in ((entry or {}).get("round_cpu") or ())[:rounds] if t is not None]
    return bool(times) and statistics.median(times) < SHORT_S * 1e6


def _ratio(entry, base, key):
    """(ratio of medians, lowest and highest ratio of one round's to the same
    round's stock) for ``key`` ("cpu": wall, "gpu": printed), or None."""
    if not entry.get(key) or not base.get(key):
        return None
    pairs = round_ratios(entry, base, key)
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
    judged = {c: [] for c in configs}  # (program, its ratios, its entry) where stock ran to the end
    paired = {c: [] for c in configs}  # each round's wall minus stock's, programs under SHORT_S
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
            ratios = {key: r for key in ("cpu", "gpu") if (r := _ratio(entry, base, key)) is not None}
            if base.get("cpu"):
                judged[config].append((case.removeprefix("program "), ratios, entry))
                if base["cpu"]["median"] < SHORT_S * 1e6:
                    paired[config].append(_differences(entry, base))
            parts = []
            for key, r in ratios.items():
                parts.append(f"×{r[0]:.3f} ({r[1]:.2f}–{r[2]:.2f})")
                speedups[config][key].append(1 / r[0])
            if entry["errors"]:
                parts.append(f"exit {entry['returncodes']}: {entry['errors'][0]}")
            cells.append(", ".join(parts))
        lines.append(f"| {case.removeprefix('program ')} | " + " | ".join(cells) + " |")
    counts = collections.Counter(len(per["stock"]["round_cpu"]) for per in rows.values() if "stock" in per)
    if len(counts) > 1:
        lines.append("\nrounds: " + ", ".join(f"{n} for {k} program{'s' * (k > 1)}"
                                                for n, k in sorted(counts.items(), reverse=True)))
    for config in configs:
        for key, what in (("cpu", "wall"), ("gpu", "printed GPU")):
            values = speedups[config][key]
            if values:
                mean = math.exp(sum(math.log(v) for v in values) / len(values))
                lines.append(f"\ngeometric mean of stock / {config}, {what} time: {mean:.3f} "
                             f"({len(values)} program{'s' * (len(values) > 1)})")
        if any(paired[config]):
            lines.append(_pairs(config, paired[config]))
        lines.append(_within(config, judged[config]))
    return "\n".join(lines)


def _differences(entry, base) -> list:
    """Each round's wall time of ``entry`` less the same round's of ``base``
    (:func:`~ump.bench.summary.round_pairs`), in milliseconds."""
    return [(a - b) / 1e3 for a, b in round_pairs(entry, base, "cpu")]


def _pairs(config: str, programs: list) -> str:
    """The median of ``programs``' differences from :func:`_differences`
    (one list per program, at least one difference in all), and how many
    were longer than stock's; a program whose every round failed is not
    counted."""
    diffs = [d for per in programs for d in per]
    counted = sum(1 for per in programs if per)
    return (f"\n{config} against stock pair by pair (the processes of one round), the {counted} programs "
            f"under {SHORT_S} s: a median {statistics.median(diffs):+.1f} ms ({sum(d > 0 for d in diffs)} of "
            f"{len(diffs)} pairs longer)")


def _within(config: str, judged: list) -> str:
    """Which programs ``config`` runs within ``WITHIN`` × stock, of those
    ``judged`` (name, ratios by key as :func:`_ratio` gives them, entry):
    by the ratio of medians, or within the spread of the rounds (one round's
    ratio at or under it); the others by name, with their spread, and a
    program with a run that failed under ``config`` (a failure is never
    within) with its exit statuses."""
    median = spread = 0
    missed = []
    for name, ratios, entry in judged:
        if entry.get("errors"):
            missed.append(f"{name} (exit {entry['returncodes']})")
        elif all(r[0] <= WITHIN for r in ratios.values()):
            median += 1
        elif all(r[1] <= WITHIN for r in ratios.values()):
            spread += 1
        else:
            missed.append(name + " (" + ", ".join(
                f"{'wall' if key == 'cpu' else 'GPU'} {r[1]:.2f}–{r[2]:.2f}" for key, r in ratios.items()
                if r[1] > WITHIN) + ")")
    text = (f"\n{config} within {WITHIN}× stock (wall and printed GPU time): {median + spread} of {len(judged)} "
            f"programs ({median} by the ratio of medians, {spread} within the spread of their rounds)")
    return text + (f"; not: {'; '.join(missed)}" if missed else "")
