"""Time each phase of two workflows of the bench, one line per repetition.

    python -m ump run tools/workflow_phases.py made            # CuPy-made 1 GiB
    UMP_BACKEND=device python -m ump run tools/workflow_phases.py made
    UMP_PLACEMENT=migrate python -m ump run tools/workflow_phases.py 10   # iterative, 10 kernels

``made``: ``cupy.random.random`` (its launch), ``cupy.asnumpy`` (the wait
for the GPU and the export), NumPy's sum. A number of kernels: the hand-off
(``cupy.asarray``), the launches, ``cupy.asnumpy``, the host's read of one
value per page. Alternate configurations process by process: the host's
speed differs between processes of one configuration (docs/performance.md,
run 10). Under ump, the placement's moves are logged (``ump.placement`` at
DEBUG) with times since start.
"""

from __future__ import annotations

import logging
import sys
import time

import cupy
import numpy as np

N = (1 << 30) // 4  # 1 GiB of float32


def _ms(a: float, b: float) -> str:
    return f"{(b - a) * 1e3:7.1f}"


def cupy_made(repeat: int = 12) -> None:
    for i in range(repeat):
        t0 = time.perf_counter()
        g = cupy.random.random(N, dtype=cupy.float32)
        t1 = time.perf_counter()
        b = cupy.asnumpy(g)
        t2 = time.perf_counter()
        mean = float(b.sum(dtype=np.float64)) / N
        t3 = time.perf_counter()
        assert 0.49 < mean < 0.51
        print(f"made {i:2d} random {_ms(t0, t1)} asnumpy {_ms(t1, t2)} sum {_ms(t2, t3)} "
              f"total {_ms(t0, t3)} ms, block {g.data.ptr:#x}")
        del g, b


def iterative(kernels: int, repeat: int = 10) -> None:
    for i in range(repeat):
        a = np.empty(N, dtype=np.float32)
        a[:] = 1.0
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        g = cupy.asarray(a)
        t1 = time.perf_counter()
        for _ in range(kernels):
            g *= 2
        t2 = time.perf_counter()
        b = cupy.asnumpy(g)
        t3 = time.perf_counter()
        assert b[::1024].sum() == (2.0 ** kernels) * (N // 1024)  # one value per page
        t4 = time.perf_counter()
        print(f"{kernels} kernels {i:2d} asarray {_ms(t0, t1)} launches {_ms(t1, t2)} "
              f"asnumpy {_ms(t2, t3)} read {_ms(t3, t4)} total {_ms(t0, t4)} ms, "
              f"block {a.ctypes.data:#x}")
        del a, g, b


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (argv[0] == "made" or argv[0].isdigit()):
        print(__doc__, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                        format="    %(relativeCreated)8.0f ms %(name)s %(message)s")
    logging.getLogger().handlers[0].addFilter(lambda r: r.name.startswith("ump"))
    if argv[0] == "made":
        cupy_made()
    else:
        iterative(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
