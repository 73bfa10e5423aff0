"""``python -m ump``: ``info`` (what this machine offers and what enable()
would pick), ``run`` (a program with ump enabled) and ``bench`` (the perf
suite)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from ._options import TABLE, argparse_type, resolve
from ._version import __version__


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _cupy_enable_ump(gpu: bool) -> str:
    value = os.environ.get("CUPY_ENABLE_UMP")
    state = "unset" if value is None else f"set to {value!r}"
    if value == "1":
        meaning = "as the GPU backends need" if gpu else "only the GPU backends use it"
    elif gpu:
        meaning = ("the GPU backends need it set to 1 before Python starts (export CUPY_ENABLE_UMP=1), "
                   "except under python -m ump run")
    else:
        meaning = "the host backend does not need it; the GPU backends need it set to 1"
    return f"CUPY_ENABLE_UMP: {state} ({meaning})"


def _backends(caps) -> tuple[dict, str | None, str | None]:
    """({backend: why it cannot run here, or None}, what enable() would
    pick, why it would pick none)."""
    from . import backends
    from ._errors import UmpError

    why = {}
    for name in backends.names():
        backend = backends.get(name)
        if backend.uses_gpu and not caps.gpu:
            why[name] = "no GPU"  # the reason is on the GPU line
        else:
            why[name] = backend.unavailable(caps, caps.devices[0] if caps.gpu else None)
    try:
        chosen = backends.select("auto", caps)
    except UmpError as err:
        return why, None, str(err)
    return why, chosen.name, None


def info_json(out=sys.stdout) -> int:
    """``info --json``: the probe, the backends and the choice as one JSON object."""
    from . import _probe

    caps = _probe.probe()
    why, chosen, none_because = _backends(caps)
    report = {"ump": __version__, **caps.as_dict(),
              "cupy_enable_ump": os.environ.get("CUPY_ENABLE_UMP"),
              "backends": {name: {"available": reason is None, "reason": reason} for name, reason in why.items()},
              "choice": chosen, "choice_reason": none_because}
    json.dump(report, out, indent=1)
    out.write("\n")
    return 0


def info(out=sys.stdout) -> int:
    from . import _probe, backends
    from ._version import pip_install

    caps = _probe.probe()
    w = out.write
    w(f"ump {__version__}\n")
    w(f"python {caps.python_version}\n")
    for name, version in (("numpy", caps.numpy_version), ("numpy_allocator", caps.numpy_allocator_version),
                          ("cupy", caps.cupy_version), ("cuda-bindings", caps.cuda_bindings_version)):
        missing = "not installed"
        if name == "cupy" and caps.gpu:
            missing += f" (the GPU backends need it: {pip_install('cuda12', 'cuda13')})"
        w(f"{name}: {version or missing}\n")
    if not caps.gpu:
        w(f"GPU: none ({caps.reason})\n")
    else:
        w(f"CUDA driver {caps.driver_version}, runtime {caps.runtime_version}\n")
        for d in caps.devices:
            w(f"device {d.index}: {d.name}, compute capability {d.compute_capability[0]}."
              f"{d.compute_capability[1]}, {_mib(d.total_memory)}\n")
            w(f"  addressing mode: {d.addressing_mode or 'None'}\n")
            w(f"  pageable memory access: {int(d.pageable_memory_access)} "
              f"(uses host page tables: {int(d.uses_host_page_tables)})\n")
            w(f"  concurrent managed access: {int(d.concurrent_managed_access)}\n")
            w(f"  host pointer for registered memory: {int(d.host_pointer_for_registered_mem)}\n")
            w(f"  VMM supported: {int(d.vmm_supported)}, granularity {_mib(d.vmm_granularity)} "
              f"(recommended {_mib(d.vmm_recommended_granularity)})\n")
    w(_cupy_enable_ump(caps.gpu) + "\n")
    why, chosen, none_because = _backends(caps)
    for name, reason in why.items():
        w(f"backend {name}: {'available' if reason is None else 'unavailable: ' + reason}\n")
    if chosen is None:
        w(f"enable() would choose: none ({none_because})\n")
    else:
        w(f"enable() would choose: {chosen}")
        if backends.get(chosen).uses_gpu and os.environ.get("CUPY_ENABLE_UMP") != "1":
            w(", once CUPY_ENABLE_UMP=1 is set (until then ump.enable() raises ump.UmpError; "
              "python -m ump run needs no variable)")
        w("\n")
    return 0


def _add_run(sub) -> argparse.ArgumentParser:
    run = sub.add_parser(
        "run", help="run a program with ump enabled",
        usage="python -m ump run [options] (script.py | -m module) [args ...]",
        description="Enable ump, then run a script or module as __main__, as python does (like "
                    "python -m cProfile): everything after the script or module is the program's. "
                    "Options not given come from the environment variables named with each. "
                    "CUPY_ENABLE_UMP=1 is not needed and not set; UMP_LAUNCHED=1 is, so that child "
                    "processes that call ump.enable() need no variable either.")
    for option in TABLE.values():
        run.add_argument(option.flag(), dest=option.name, metavar=option.metavar, choices=option.choices,
                         type=None if option.choices else argparse_type(option),
                         help=option.describe())
    run.add_argument("-m", dest="module", action="store_true",
                     help="the program is a module, run as python -m runs it")
    run.add_argument("program", nargs="?", metavar="script.py | module", help="the script, or with -m the module")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")
    return run


def _run(run: argparse.ArgumentParser, args) -> int:
    from . import _launch
    from ._errors import UmpError

    if args.program is None:
        run.error("name a script or -m MODULE")
    script = None if args.module else args.program
    if script is not None and not os.path.isfile(script):
        run.error(f"{script}: no such file")
    try:
        backend, options = resolve({name: getattr(args, name) for name in TABLE})
        _launch.start(backend, options)
    except (ValueError, TypeError, UmpError) as err:
        run.error(str(err))
    if args.module:
        # Checked as python -m checks it, once ump is enabled (the module's
        # package may allocate as it imports): one line, not runpy's traceback.
        _launch.program_path()
        why = _module_missing(args.program)
        if why:
            run.error(f"-m {args.program}: {why}")
    _launch.run(module=args.program if args.module else None, script=script, args=args.args)
    return 0


def _module_missing(name: str) -> str | None:
    """Why ``python -m name`` could not run ``name``, or None."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            if importlib.util.find_spec(f"{name}.__main__") is None:
                return f"{name} is a package and has no __main__ module"
    except ModuleNotFoundError:  # a parent package
        spec = None
    except (ImportError, ValueError) as err:  # a parent package that fails to import
        return f"{type(err).__name__}: {err}"
    return None if spec is not None else f"no module named {name!r}"


def _bench_epilog() -> str:
    from . import bench
    from .bench.cases import CPU_SUITES, GPU_SUITES, ON_REQUEST

    lines = ["suites (default: all this machine runs):"]
    for name in (*CPU_SUITES, *GPU_SUITES):
        note = f"; only when named: {ON_REQUEST[name]}" if name in ON_REQUEST else ""
        lines.append(f"  {name:<17}{'CPU' if name in CPU_SUITES else 'GPU'}{note}")
    lines.append(f"  {bench.PROGRAMS:<17}GPU; only when named: CuPy's examples, unedited, stock against "
                 "python -m ump run (--programs)")
    lines.append("configurations (default: all this machine runs):")
    for name in bench.KNOWN_CONFIGS:
        backend, _, placement = name.partition(":")
        what = {"stock": "CuPy alone (ump never imported)", "imported": "ump imported, not enabled",
                "auto": "ump.enable() with default options (when named)"}.get(
            name, f"ump enabled with the {backend} backend" + (f", placement {placement}" if placement else ""))
        lines.append(f"  {name:<17}{what}")
    return "\n".join(lines)


def _add_bench(sub) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="run the perf suite: stock CuPy vs ump",
                           description="Run the perf suite, each configuration in a process of its own; "
                                       "print a table, write JSON and a plot, compare with an earlier run.",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--smoke", action="store_true", help="tiny sizes, a few repeats (CI)")
    bench.add_argument("--suites", help="comma-separated suites (default: all the machine runs)")
    bench.add_argument("--configs", help="comma-separated configurations (default: all)")
    bench.add_argument("--output", default="bench-results/bench.json",
                       help="JSON file to write (%(default)s); while the run goes on, what has finished is in "
                            "NAME.partial.json beside it")
    bench.add_argument("--plot", default="bench-results/interop.png", help="PNG plot to write (%(default)s)")
    bench.add_argument("--compare", metavar="OLD.json", help="flag slow-downs against OLD.json")
    bench.add_argument("--input", metavar="NEW.json",
                       help="run nothing: print this saved report's tables (with --compare: compare it)")
    bench.add_argument("--threshold", type=float, default=1.25, help="slow-down ratio to flag (%(default)s)")
    bench.add_argument("--programs", metavar="DIR", action="append",
                       help="a folder of programs the programs suite runs: CuPy's examples/, a PyLops checkout "
                            "(once per folder; default: $UMP_BENCH_PROGRAMS)")
    bench.add_argument("--only", metavar="NAMES",
                       help="comma-separated programs the programs suite runs, by name or the first words "
                            "of it (cg,stream: cg and the stream examples; default: all)")
    bench.add_argument("--rounds", type=_at_least_one, default=1,
                       help="run every configuration this many times, interleaved (spread across processes)")
    bench.add_argument("--short-rounds", type=_at_least_one, metavar="N",
                       help="rounds of the programs that stock runs in under 2.5 s (its median over --rounds "
                            "rounds), where the spread between processes is widest (default: twice --rounds)")
    bench.add_argument("--resume", metavar="PARTIAL.json",
                       help="with --suites programs: go on with a run that stopped, from its partial report; its "
                            "runs are kept, the others run (the same --configs, --rounds, --short-rounds, --only, "
                            "--cpus)")
    bench.add_argument("--cpus", metavar="LIST",
                       help="run every process on these CPUs (0,7,11 or 8-15), so that all configurations "
                            "meet the same ones (default: wherever the system puts them)")
    return bench


def _check_writable(parser, flag: str, path: str) -> None:
    """Refuse an output a long run could not write at its end."""
    path = os.path.abspath(path)
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as err:
        parser.error(f"{flag}: cannot write {path}: {err.strerror or err}")
    if not existed:
        os.unlink(path)


def _bench(parser, args) -> int:
    from . import bench as bench_mod

    if args.input and args.resume:
        parser.error("--resume and --input cannot be combined: --resume runs what a run left, --input runs nothing")
    if not args.input:
        _check_writable(parser, "--output", args.output)
        _check_writable(parser, "--output", bench_mod.partial_path(args.output))  # written while it runs
        if args.plot:
            _check_writable(parser, "--plot", args.plot)
    try:
        return bench_mod.main(args)
    except bench_mod.ArgumentError as err:
        parser.error(str(err))
    except KeyboardInterrupt:
        # Stopping a run (Ctrl-C, `timeout -s INT`) is how a long one is cut
        # short for --resume: bench.main has named the partial report, if
        # a run had finished to write one.
        print("bench: stopped", file=sys.stderr)
        return 130


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ump", description="Unified memory for NumPy and CuPy.")
    parser.add_argument("--version", action="version", version=f"ump {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,run,bench}")
    info_parser = sub.add_parser("info", help="report the probe and the backend enable() would pick")
    info_parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    run = _add_run(sub)
    bench = _add_bench(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        bench.epilog = _bench_epilog()  # imports the suites: only where they are asked about
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(run, args)  # the program's own output: a closed pipe is its to meet
    try:
        if args.command == "info":
            return info_json() if args.json else info()
        return _bench(bench, args)
    except BrokenPipeError:
        # The reader went away (`python -m ump info | head -3`): stop quietly
        # as other command-line tools do. stdout goes to /dev/null so that
        # flushing it at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
