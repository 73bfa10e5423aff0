"""NumPy's CPU work on four kinds of memory, alternated in one process.

    python tools/numpy_on_managed.py [ROUNDS]

The kinds: ``stock`` (NumPy's own allocator, before ``ump.enable()``),
``huge`` and ``small`` (anonymous private mappings advised
``MADV_HUGEPAGE`` and ``MADV_NOHUGEPAGE``), and ``ump`` (arrays made after
``ump.enable()``: managed memory on a GPU without HMM/ATS, whose host pages
the driver maps 4 KiB at a time). No GPU work is done. The workloads are
cg.py's CPU part (a matrix-vector product over 2000 x 2000 doubles), a sort
of 8 Mi doubles, three ufuncs over them, and an integer matrix product (no
BLAS). Prints each workload's times in ms per kind, round by round (the
first round is left out), then the mapping and page sizes of each kind's
large buffer (``/proc/self/smaps``): the kind is what the mapping says, not
what was asked for.
"""

from __future__ import annotations

import mmap
import re
import sys
import time

import numpy as np

N = 2000      # cg.py's matrix
SORTED = 1 << 23
INT = 600


def _mapped(advice):
    kept = []  # the mappings live as long as their arrays

    def alloc(shape, dtype):
        m = mmap.mmap(-1, int(np.prod(shape)) * np.dtype(dtype).itemsize,
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(advice)
        kept.append(m)
        return np.frombuffer(m, dtype).reshape(shape)
    return alloc


def _arrays(alloc) -> dict:
    return {"A": alloc((N, N), np.float64), "x": alloc((SORTED,), np.float64), "z": alloc((SORTED,), np.float64),
            "ai": alloc((INT, INT), np.int64), "ci": alloc((INT, INT), np.int64)}


def _mapping(address: int) -> str:
    """The smaps entry holding ``address``: its name and page sizes."""
    entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read())
    for entry in entries:
        start, end = (int(v, 16) for v in entry.split()[0].split("-"))
        if start <= address < end:
            head = entry.split("\n")[0].split()
            fields = dict(re.findall(r"^(\w+):\s+(.*)$", entry, re.M))
            return (f"{head[5] if len(head) > 5 else '[anon]'}: page {fields.get('KernelPageSize')}, "
                    f"rss {fields.get('Rss')}, huge {fields.get('AnonHugePages')}")
    return "not found"


def _work(a: dict, x0, p) -> dict:
    t = {}
    t0 = time.perf_counter()
    for _ in range(40):
        a["A"].dot(p)
    t["matrix-vector x40"] = time.perf_counter() - t0
    a["x"][...] = x0
    t0 = time.perf_counter()
    a["x"].sort()
    t["sort 8 Mi"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    np.sqrt(a["x"], out=a["z"])
    np.sin(a["x"], out=a["z"])
    np.multiply(a["z"], 2.0, out=a["z"])
    t["3 ufuncs, 64 MiB"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    np.matmul(a["ai"], a["ai"].T, out=a["ci"])
    t["int matmul 600"] = time.perf_counter() - t0
    return t


def main(rounds: int = 3) -> None:
    rng = np.random.default_rng(0)
    a0, x0, i0, p = (rng.integers(-50, 50, (N, N)).astype(np.float64), rng.random(SORTED),
                     rng.integers(-50, 50, (INT, INT)), rng.random(N))
    kinds = {"stock": _arrays(np.empty), "huge": _arrays(_mapped(mmap.MADV_HUGEPAGE)),
             "small": _arrays(_mapped(mmap.MADV_NOHUGEPAGE))}
    import ump

    ump.enable()
    kinds["ump"] = _arrays(np.empty)
    print("ump's arrays:", ump.kind_of(kinds["ump"]["A"]), flush=True)
    for a in kinds.values():
        a["A"][...], a["ai"][...] = a0, i0
    times: dict = {}
    names = list(kinds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each kind first in turn
            for work, s in _work(kinds[name], x0, p).items():
                times.setdefault(work, {}).setdefault(name, []).append(s * 1e3)
    for work, by in times.items():
        print(f"{work:18s} " + "  ".join(f"{n}: " + ", ".join(f"{v:.1f}" for v in by[n][1:]) for n in names))
    for name, a in kinds.items():
        print(f"{name}: {_mapping(a['x'].ctypes.data + a['x'].nbytes // 2)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
