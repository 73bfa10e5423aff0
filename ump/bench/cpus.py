"""The CPUs a bench run's processes run on (``bench --cpus``), as pyperf's
``--affinity`` does.

On a virtual machine a virtual CPU can run a process much slower than
the others, for seconds or minutes: on a 16-CPU H100 virtual machine, a CuPy
loop bound by its dispatch (cg.py's iteration: ~15 launches and one
scalar read) took 626 and 651 µs per iteration pinned to CPU 3, 366–483 µs
pinned to CPUs 0, 7, 11 or 15, and 365–690 µs left free (one process in
four in the slow mode; docs/performance.md). A program that prints its own
GPU time measures its host's dispatch as much as the GPU, so whichever
configuration's process met a slow CPU looked slower. ``--cpus 0,7,11``
(ranges too: ``8-15``) pins the bench process, and so every process it
starts, to those CPUs: all configurations meet the same ones.

Which CPUs are slow cannot be told beforehand: a pure-Python loop timed
on each CPU of another such guest ranked them differently twice in a row,
and ranked neither the fastest nor the slowest CPU of the CuPy loop.
"""

from __future__ import annotations

import os

__all__ = ["allowed", "parse", "ranges", "pin"]


def allowed() -> list[int]:
    """The CPUs this process may run on.

    Raises
    ------
    ValueError
        The system cannot pin a process to CPUs (``os.sched_setaffinity``
        is Linux's).
    """
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("--cpus needs os.sched_setaffinity, which this system does not have")
    return sorted(os.sched_getaffinity(0))


def parse(spec: str, usable) -> list[int]:
    """The CPUs ``spec`` names (``"0,7,11"``, ``"8-15"``, or both mixed),
    each of which must be in ``usable``.

    Raises
    ------
    ValueError
        A malformed item, an empty range, or a CPU not in ``usable``.
    """
    cpus: set[int] = set()
    for item in spec.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--cpus: {item.strip()!r} is not a CPU number or a range a-b") from None
        if first < 0 or last < first:
            raise ValueError(f"--cpus: {item.strip()!r} names no CPU")
        cpus.update(range(first, last + 1))
    missing = sorted(cpus - set(usable))
    if missing:
        raise ValueError(f"--cpus: this process cannot run on CPU {', '.join(map(str, missing))}; "
                         f"it may use {ranges(usable)}")
    return sorted(cpus)


def ranges(cpus) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    out, cpus = [], sorted(cpus)
    start = prev = None
    for cpu in cpus + [None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(out)


def pin(cpus) -> None:
    """Run this process, and every process it starts from now on, on ``cpus``."""
    os.sched_setaffinity(0, set(cpus))
