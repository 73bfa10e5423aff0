"""ump's start and a program's exit, phase by phase, against stock CuPy.

    python tools/startup_phases.py PAIRS SCRIPT [SCRIPT ...]

For each script, one process of each way first, not counted (it fills the
kernel cache and the page cache), then PAIRS rounds of one process of each
way, the order turned every round. Each process stamps its start, CuPy's
import, CUDA's start (``cupy.cuda.runtime.memGetInfo()``), ump's start,
the script's end and its last ``atexit`` handler; the parent stamps the
launch and the exit. Prints each phase's median in ms, per script and way:
``launch`` (to the child's first line, this tool's own imports included,
the same for every way), ``cupy``, ``cuda``, ``ump``, ``program`` (the
script), ``atexit`` (the other handlers and the joins of the script's
threads), ``exit`` (from the last handler until the parent sees the
process end) and ``total``.

The ways (``UMP_STARTUP_WAYS``, comma-separated; ``stock,ump`` unless set),
each started without the caller's ump settings (``UMP_*``,
``CUPY_ENABLE_UMP``): ``stock`` never imports ump; ``ump`` calls :func:`ump._launch.start`
(``auto``), what ``python -m ump run`` calls, but after CuPy was imported
with ``CUPY_ENABLE_UMP=1`` set, as in a program that imports CuPy before
``ump.enable()``; ``before`` does the same with the ``ump`` package found
under the folder ``UMP_STARTUP_BEFORE`` names (an older checkout, its C
extension built), to time a change against the code before it. CuPy's
import and CUDA's start are phases of their own for every way, so ump's
start is timed apart from them (docs/performance.md, run 34).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

PHASES = ("launch", "cupy", "cuda", "ump", "program", "atexit", "exit", "total")
WAYS = ("stock", "ump", "before")


def child(way: str, script: str) -> None:
    import atexit
    import runpy

    t = {"start": time.time()}
    atexit.register(lambda: print("STAMPS " + json.dumps({**t, "atexit": time.time()}), flush=True))
    import cupy

    t["cupy"] = time.time()
    cupy.cuda.runtime.memGetInfo()
    t["cuda"] = time.time()
    if way != "stock":
        from ump._launch import start

        start("auto", {})
        t["ump"] = time.time()
        t["where"] = sys.modules["ump"].__file__
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # sys.exit() in the script too
        t["program"] = time.time()


def _env(way: str) -> dict:
    """The caller's environment without ump's settings, as the bench's
    configurations start (a ``UMP_BACKEND`` left in the shell would turn
    ``auto`` into another backend; stock CuPy with ``CUPY_ENABLE_UMP`` set
    takes its own UMP path), then the way's own."""
    from ump.bench.programs import without_ump_settings

    env = without_ump_settings()
    if way != "stock":
        env["CUPY_ENABLE_UMP"] = "1"
    if way == "before":
        before = os.environ.get("UMP_STARTUP_BEFORE")
        if not before:
            sys.exit("the way `before` needs UMP_STARTUP_BEFORE: a folder holding the older ump package")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(before), env.get("PYTHONPATH")]))
    return env


def _phases(stamps: dict, launched: float, ended: float) -> dict:
    cupy, cuda = stamps["cupy"], stamps["cuda"]
    ump = stamps.get("ump", cuda)
    return {"launch": stamps["start"] - launched, "cupy": cupy - stamps["start"], "cuda": cuda - cupy,
            "ump": ump - cuda, "program": stamps["program"] - ump, "atexit": stamps["atexit"] - stamps["program"],
            "exit": ended - stamps["atexit"], "total": ended - launched}


def parent(pairs: int, scripts: list[str], ways: tuple[str, ...]) -> None:
    rows, where = {}, {}
    envs = {way: _env(way) for way in ways}  # once, and outside the timed launch
    for script in scripts:
        for way in ways:  # warm-up, not counted
            subprocess.run([sys.executable, __file__, "child", way, script], env=envs[way], capture_output=True)
        for i in range(pairs):
            for way in ways if i % 2 == 0 else ways[::-1]:
                launched = time.time()
                out = subprocess.run([sys.executable, __file__, "child", way, script], env=envs[way],
                                     capture_output=True, text=True)
                ended = time.time()
                stamps = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("STAMPS ")]
                if out.returncode or not stamps:
                    print(f"{script} ({way}) failed, status {out.returncode}:\n{out.stderr[-800:]}")
                    continue
                where.setdefault(way, set()).add(stamps[0].pop("where", "-"))
                rows.setdefault((os.path.basename(script), way), []).append(_phases(stamps[0], launched, ended))
    print("ump imported from:", {way: sorted(paths) for way, paths in where.items()})
    for (name, way), runs in rows.items():
        medians = " ".join(f"{p} {statistics.median(r[p] for r in runs) * 1e3:7.1f}" for p in PHASES)
        print(f"{name:28s} {way:6s} {medians}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 2:
        ways = tuple(os.environ.get("UMP_STARTUP_WAYS", "stock,ump").split(","))
        if set(ways) - set(WAYS):
            sys.exit(f"UMP_STARTUP_WAYS: {', '.join(sorted(set(ways) - set(WAYS)))} is not one of {', '.join(WAYS)}")
        parent(int(sys.argv[1]), sys.argv[2:], ways)
    else:
        sys.exit(__doc__)
