"""Time one step of CuPy's conjugate-gradient example by where its matrix lives.

    python tools/cg_step.py stock                 # stock CuPy (no ump)
    python -m ump run tools/cg_step.py auto       # ump, default placement
    python tools/cg_step.py alternate             # both in one process, block by block

The GPU loop of ``examples/cg/cg.py`` (v14.2.0) on a 2000 x 2000 matrix
made by NumPy, in blocks of 200 steps, three copies of the matrix taking
turns block by block so that a change in the process's speed reaches all of
them: ``handed`` (``cupy.asarray`` of NumPy's matrix: under ump, NumPy's
block itself, which the placement moves to the GPU during the warm-up),
``pool`` (a copy in the memory of CuPy's current allocator) and ``raw`` (a
copy in memory from ``cudaMalloc``). Each line gives the median block (of
eight, the higher middle one) and the fastest, in µs per step, and the same
for the matrix-vector product alone, timed by events over 200 launches.
Alternate configurations process by process: the host's speed differs
between processes of one configuration (docs/performance.md, run 11).

``alternate`` takes that difference out: one process, ``ump.enable()`` and
``ump.disable()`` block by block (the first of each pair turning), stock
CuPy's blocks on a copy of the matrix in CuPy's own pool, ump's on a matrix
NumPy made under ump and handed over, placed during a warm-up of its own.
Each configuration is timed with cg's scalar read each step and with the
comparison left unread (``noread``); the last line gives ump's block less
stock's block of the same pair, per step. ``CUPY_ENABLE_UMP=1`` as
``ump.enable()`` needs it; the first ``enable()`` imports CuPy with CuPy's
own UMP path off, so between ``disable()`` and ``enable()`` CuPy is stock.
"""

from __future__ import annotations

import sys
import time
from statistics import median_high

import numpy as np

if __name__ == "__main__" and sys.argv[1:2] == ["alternate"]:
    import ump

    ump.enable()  # CuPy imported with its own UMP path off, as without the variable
    ump.disable()
import cupy  # noqa: E402

N, STEPS, BLOCKS = 2000, 200, 8


def fit(A, b, steps: int, read: bool = True):
    """cg.py's ``fit`` on the GPU, ``steps`` iterations; its scalar read each
    step (``if norm(r1) < tol``) with a tolerance never met (``read=False``:
    the comparison is made and not read)."""
    x = cupy.zeros_like(b, dtype=np.float64)
    r0 = b - cupy.dot(A, x)
    p = r0
    for _ in range(steps):
        a = cupy.inner(r0, r0) / cupy.inner(p, cupy.dot(A, p))
        x += a * p
        r1 = r0 - a * cupy.dot(A, p)
        below = cupy.linalg.norm(r1) < 1e-300
        if read and below:
            break
        beta = cupy.inner(r1, r1) / cupy.inner(r0, r0)
        p = r1 + beta * p
        r0 = r1
    return x


def _host_matrix():
    rng = np.random.default_rng(0)
    A = rng.integers(-50, 50, size=(N, N))
    A = (A @ A.T).astype(np.float64)
    return A, A @ rng.integers(-50, 50, size=N).astype(np.float64)


def _matrices():
    A, b = _host_matrix()
    handed = cupy.asarray(A)
    raw = cupy.ndarray(A.shape, A.dtype,
                       memptr=cupy.cuda.MemoryPointer(cupy.cuda.memory.Memory(A.nbytes), 0))
    raw[...] = handed
    return {"handed": handed, "pool": handed.copy(), "raw": raw}, cupy.asarray(b)


def _timed_steps(A, b, read: bool = True) -> float:
    """µs per step of ``STEPS`` steps of ``fit``, the device idle before and after."""
    cupy.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    fit(A, b, STEPS, read)
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t) / STEPS * 1e6


def main(tag: str) -> None:
    matrices, b = _matrices()
    fit(matrices["handed"], b, 300)  # warm-up: kernels compiled, the block placed
    cupy.cuda.runtime.deviceSynchronize()
    steps = {k: [] for k in matrices}
    gemv = {k: [] for k in matrices}
    p = cupy.ones(N)
    for _ in range(BLOCKS):
        for name, A in matrices.items():
            steps[name].append(_timed_steps(A, b))
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(STEPS):
                A @ p
            end.record()
            end.synchronize()
            gemv[name].append(cupy.cuda.get_elapsed_time(start, end) / STEPS * 1e3)
    for name in matrices:
        print(f"{tag:6s} {name:7s} step µs median {median_high(steps[name]):.1f} min {min(steps[name]):.1f}"
              f" | gemv µs median {median_high(gemv[name]):.2f} min {min(gemv[name]):.2f}")


def _block(A, b, read: bool) -> float:
    """:func:`_timed_steps` after a warm-up of 60 steps."""
    fit(A, b, 60, read)
    return _timed_steps(A, b, read)


def alternate() -> None:
    import ump

    A, b = _host_matrix()
    times = {(config, read): [] for config in ("stock", "auto") for read in (True, False)}
    for block in range(BLOCKS):
        for config in ("stock", "auto") if block % 2 == 0 else ("auto", "stock"):
            if config == "auto":
                ump.enable()
                host_A, host_b = A.copy(), b.copy()  # NumPy's blocks in ump's memory
                Ag, bg = cupy.asarray(host_A), cupy.asarray(host_b)
            else:
                Ag, bg = cupy.asarray(A), cupy.asarray(b)  # copies in CuPy's pool
            for read in (True, False):
                times[config, read].append(_block(Ag, bg, read))
            del Ag, bg
            if config == "auto":
                del host_A, host_b
                ump.disable()
    for (config, read), t in times.items():
        print(f"{config:6s} {'read' if read else 'noread':7s} step µs median {median_high(t):.1f} min {min(t):.1f}")
    for read in (True, False):
        less = [a - s for a, s in zip(times["auto", read], times["stock", read])]
        print(f"auto - stock {'read' if read else 'noread':7s} µs per step, pair by pair: median "
              f"{median_high(less):.1f} ({' '.join(f'{x:.0f}' for x in less)})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["alternate"]:
        alternate()
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "")
