"""``python -m ump info``: what this machine offers and what enable() would pick."""

from __future__ import annotations

import argparse
import os
import sys

from . import _probe, backends
from ._errors import UmpError


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


def info(out=sys.stdout) -> int:
    caps = _probe.probe()
    w = out.write
    w(f"ump {__import__('ump').__version__}\n")
    w(f"python {caps.python_version}\n")
    for name, version in (("numpy", caps.numpy_version), ("numpy_allocator", caps.numpy_allocator_version),
                          ("cupy", caps.cupy_version), ("cuda-bindings", caps.cuda_bindings_version)):
        missing = "not installed"
        if name == "cupy" and caps.gpu:
            missing += " (the GPU backends need it: pip install ump[cuda12] or ump[cuda13])"
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
    for name in backends.names():
        backend = backends.get(name)
        if backend.uses_gpu and not caps.gpu:
            why = "no GPU"  # the reason is on the GPU line above
        else:
            why = backend.unavailable(caps, caps.devices[0] if caps.gpu else None)
        w(f"backend {name}: {'available' if why is None else 'unavailable: ' + why}\n")
    try:
        chosen = backends.select("auto", caps)
    except UmpError as err:
        w(f"enable() would choose: none ({err})\n")
    else:
        w(f"enable() would choose: {chosen.name}")
        if chosen.uses_gpu and os.environ.get("CUPY_ENABLE_UMP") != "1":
            w(", once CUPY_ENABLE_UMP=1 is set (until then ump.enable() raises ump.UmpError; "
              "python -m ump run needs no variable)")
        w("\n")
    return 0


_RUN_OPTIONS = ("backend", "cap", "headroom", "placement", "sync", "device")


def _split_run(argv):
    """(launcher options, module, script, program arguments): the launcher's
    options end at ``-m MODULE`` or at the script, as Python's own do, so
    everything after belongs to the program (``-m pytest -x``)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[:i], (argv[i + 1] if i + 1 < len(argv) else ""), None, argv[i + 2:]
        if arg.startswith("-m") and not arg.startswith("--"):
            return argv[:i], arg[2:], None, argv[i + 1:]
        if not arg.startswith("-"):
            return argv[:i], None, arg, argv[i + 1:]
        i += 2 if arg.lstrip("-") in _RUN_OPTIONS else 1
    return argv, None, None, []


def _run(parser, argv) -> int:
    from . import _launch

    options, module, script, program = _split_run(argv)
    args = parser.parse_args(["run", *options])
    if not (module or script):
        parser.error("run: name a script or -m MODULE")
    if script is not None and not os.path.isfile(script):
        parser.error(f"run: {script}: no such file")
    try:
        backend, settings = _launch.settings({k: getattr(args, k) for k in _RUN_OPTIONS})
        _launch.start(backend, settings)
    except (ValueError, TypeError, UmpError) as err:
        parser.error(f"run: {err}")
    _launch.run(module=module, script=script, args=program)
    return 0


class _Parser(argparse.ArgumentParser):
    """Bad arguments get one line on stderr and exit status 2, not the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = _Parser(prog="python -m ump")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="report the probe and the backend enable() would pick")
    bench = sub.add_parser("bench", help="run the perf suite: stock CuPy vs ump")
    bench.add_argument("--smoke", action="store_true", help="tiny sizes, a few repeats (CI)")
    bench.add_argument("--suites", help="comma-separated suites (default: all the machine runs)")
    bench.add_argument("--configs", help="comma-separated configurations (default: all)")
    bench.add_argument("--output", default="bench-results/bench.json", help="JSON file to write")
    bench.add_argument("--plot", default="bench-results/interop.png", help="PNG plot to write")
    bench.add_argument("--compare", metavar="OLD.json", help="flag slow-downs against OLD.json")
    bench.add_argument("--input", metavar="NEW.json", help="with --compare: compare this file, run nothing")
    bench.add_argument("--threshold", type=float, default=1.25, help="slow-down ratio to flag")
    bench.add_argument("--programs", metavar="DIR",
                       help="CuPy's examples/ folder, which the programs suite runs (default: $UMP_BENCH_PROGRAMS)")
    bench.add_argument("--rounds", type=_at_least_one, default=1,
                       help="run every configuration this many times, interleaved (spread across processes)")
    run = sub.add_parser(
        "run", help="run a program with ump enabled: python -m ump run [options] script.py|-m module [args]",
        description="Enable ump, then run a script or module as __main__ (like python -m cProfile). "
                    "Options not given come from UMP_BACKEND, UMP_CAP, UMP_HEADROOM, UMP_PLACEMENT, "
                    "UMP_SYNC, UMP_DEVICE. CUPY_ENABLE_UMP=1 is not needed and not set; UMP_LAUNCHED=1 "
                    "is, so that child processes that call ump.enable() need no variable either.")
    run.add_argument("--backend", help="auto (default), system, managed, pinned, device or host")
    run.add_argument("--cap", help="budget: bytes (4G, 512MiB; a whole number is bytes) or a fraction "
                                   "in (0, 1] of free device memory (0.5)")
    run.add_argument("--headroom", help="device memory left to others (bytes, 1G)")
    run.add_argument("--placement", choices=("auto", "host", "migrate"))
    run.add_argument("--sync", choices=("device", "stream"))
    run.add_argument("--device", help="CUDA device index")
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m")
    run.add_argument("script", nargs="?", help="the script, followed by its arguments")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        return _run(parser, argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "bench":
        from . import bench as bench_mod

        try:
            return bench_mod.main(args)
        except bench_mod.ArgumentError as err:
            bench.error(str(err))
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
