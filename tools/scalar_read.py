"""Time a scalar read: ``bool()`` of a 0-d CuPy array, on an idle GPU and
right behind the kernels that make it.

    python tools/scalar_read.py stock            # stock CuPy (no ump)
    python -m ump run tools/scalar_read.py auto  # ump, default options

``idle``: the read of an array made before, the GPU idle. ``behind``: the
read of ``norm(x) < tol`` (what a solver reads each step) minus the same
loop without the read, so what the read adds behind its kernels. Under ump
the read is timed twice: while every stream is one CUDA's legacy default
stream follows (the copy queued before the wait), then after the program
made a non-blocking stream (the wait, then the copy: docs/guide.md,
"Coherence"): the first phase first, since the stream switches the
process for good. Five blocks a phase, the two kinds of read taking turns;
each line gives the median block and the fastest, in µs a read. Alternate
configurations process by process (docs/performance.md, run 11).
"""

from __future__ import annotations

import sys
import time
from statistics import median

import cupy

IDLE, BEHIND, BLOCKS = 3000, 1000, 5


def _loop(x, n: int, read: bool) -> float:
    """µs per pass of ``n`` passes of ``norm(x) < tol``, each read if ``read``."""
    cupy.cuda.runtime.deviceSynchronize()
    start = time.perf_counter()
    for _ in range(n):
        flag = cupy.linalg.norm(x) < 1e-300
        if read:
            bool(flag)
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - start) / n * 1e6


def _idle(x, n: int) -> float:
    flag = cupy.linalg.norm(x) < 1e-300
    cupy.cuda.runtime.deviceSynchronize()
    start = time.perf_counter()
    for _ in range(n):
        bool(flag)
    return (time.perf_counter() - start) / n * 1e6


def _blocks(x) -> tuple[list, list]:
    idle, behind = [], []
    for _ in range(BLOCKS):
        idle.append(_idle(x, IDLE))
        behind.append(_loop(x, BEHIND, True) - _loop(x, BEHIND, False))
    return idle, behind


def main(tag: str) -> None:
    x = cupy.ones(2000)
    _idle(x, 200)  # kernels compiled, pools warm
    _loop(x, 200, True)
    first = _blocks(x)
    if tag == "stock":
        phases = {"": first}
    else:
        cupy.cuda.Stream(non_blocking=True)  # from here on, for good, a scalar read waits first
        phases = {" legacy stream first": first, " after a non-blocking stream": _blocks(x)}
    for phase, (idle, behind) in phases.items():
        print(f"{tag}{phase}: idle read µs median {median(idle):.1f} min {min(idle):.1f}"
              f" | behind its kernels µs median {median(behind):.1f} min {min(behind):.1f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
