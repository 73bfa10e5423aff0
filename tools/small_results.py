"""A small result read back by the host each step, as a solver does.

    python tools/small_results.py [ROWS]            # stock CuPy
    python -m ump run tools/small_results.py [ROWS] # under ump

Each step a matrix-vector product makes ``y`` (ROWS float64, default 300:
2.4 KB; 100000 is 800 KB) on the GPU, and the host gets it back. Prints
microseconds per step (fastest and median of three runs of 500 steps) for:
the product alone; ``y.get()`` and ``cupy.asnumpy(y)`` with the host
summing the result; ``y.get()`` unread; and a copy into pinned memory by
``cudaMemcpy`` (the least a copy costs). Under ump, ``get()`` copies a
result this small out of managed memory rather than sharing it
(docs/backends.md): run it on both sides to compare.
"""

from __future__ import annotations

import sys
import time

import cupy as cp
import numpy

STEPS, RUNS = 500, 3


def main(rows: int) -> None:
    rt = cp.cuda.runtime
    cp.random.seed(0)
    a, x = cp.random.randn(rows, 200), cp.random.randn(200)
    pinned_memory = cp.cuda.alloc_pinned_memory(rows * 8)
    pinned = numpy.frombuffer(pinned_memory, numpy.float64, rows)

    def product_alone():
        return a @ x

    def get_read():
        return (a @ x).get().sum()

    def asnumpy_read():
        return cp.asnumpy(a @ x).sum()

    def get_unread():
        return (a @ x).get()

    def pinned_copy_read():
        y = a @ x
        rt.memcpy(pinned_memory.ptr, y.data.ptr, y.nbytes, rt.memcpyDeviceToHost)
        return pinned.copy().sum()

    for step in (product_alone, get_read, asnumpy_read, get_unread, pinned_copy_read):
        for _ in range(100):
            step()
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(RUNS):
            start = time.perf_counter()
            for _ in range(STEPS):
                step()
            cp.cuda.Device().synchronize()
            times.append((time.perf_counter() - start) / STEPS * 1e6)
        print(f"{step.__name__:18s} {min(times):8.1f} {sorted(times)[RUNS // 2]:8.1f} us", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
