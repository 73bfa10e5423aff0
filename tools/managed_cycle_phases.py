"""The managed cycle under the iterative workflow, phase by phase, with what
the guest can see of its CPU meanwhile.

    python tools/managed_cycle_phases.py [REPEATS] [CPU] [ADVICE]

One 1 GiB buffer of ``cudaMallocManaged`` memory on GPU 0, no ump in the
loop. Each repetition: the host writes one value in every page, then the
prefetch to the GPU, ten ``*= 2``, the prefetch back and the host's read of
one value per page, each timed to its end; then, apart, a DMA of 1 GiB of
device memory into pinned memory. Beside them: the steal time of the
guest's CPUs (``/proc/stat``, in ticks: the hypervisor ran something else),
and this thread's time on a CPU and waiting for one (``/proc/self/
schedstat``). ``CPU`` pins the process to that CPU (its steal is printed
too). ``ADVICE`` gives the buffer advice first, as ump's NumPy chunks
have: ``none`` (the default), ``both`` (preferred location host, accessed
by GPU 0: ump's), ``preferred`` or ``accessed`` (one of the two), or
``drop`` (both, unset before each prefetch there and set again after the
read; the calls timed in column ``advice``). Prints one line per
repetition, in ms (docs/backends.md: the slow mode of the way back).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import cupy
import numpy as np

from ump import _core

GiB = 1 << 30
N = GiB // 4


def _steal(cpu: int) -> tuple[int, int | None]:
    with open("/proc/stat") as f:
        lines = f.read().split("\n")
    total = int(lines[0].split()[8])
    mine = next((int(line.split()[8]) for line in lines if line.startswith(f"cpu{cpu} ")), None)
    return total, mine


def _sched() -> tuple[int, int]:
    with open("/proc/self/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu), int(waiting)


_ADVICE = {"none": (), "both": ("preferred_location", "accessed_by"), "drop": ("preferred_location", "accessed_by"),
           "preferred": ("preferred_location",), "accessed": ("accessed_by",)}


def _advise(ptr: int, names, unset: bool = False) -> None:
    for name in names:
        _core.advise(ptr, GiB, _core.ADVICE[("unset_" if unset else "") + name],
                     -1 if name == "preferred_location" else 0)


def main(repeats: int, cpu: int, advice: str) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    _core.cuda_load()
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    ptr = rt.mallocManaged(GiB, 1)  # cudaMemAttachGlobal
    host = np.ctypeslib.as_array((ctypes.c_float * N).from_address(ptr))
    gpu = cupy.ndarray((N,), cupy.float32, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, GiB, None), 0))
    device = cupy.ones(N, cupy.float32)
    pinned = cupy.cuda.alloc_pinned_memory(GiB)
    _advise(ptr, _ADVICE[advice])
    host[:] = 1.0

    def clock(call):
        """(ms, what ``call`` returned)."""
        start = time.perf_counter()
        result = call()
        return (time.perf_counter() - start) * 1e3, result

    def timed(call) -> float:
        return clock(lambda: (call(), stream.synchronize()))[0]

    def kernels():
        with stream:
            for _ in range(10):
                gpu.__imul__(2)

    print(f"advice {advice}", flush=True)
    print("rep  there kernels   back  read  cycle advice    dma | steal all, cpu | on cpu, waiting ms", flush=True)
    try:
        for rep in range(repeats):
            host[::1024] = 1.0
            steal0, sched0 = _steal(cpu), _sched()
            advised = clock(lambda: _advise(ptr, _ADVICE[advice], unset=True))[0] if advice == "drop" else 0.0
            there = timed(lambda: _core.prefetch(ptr, GiB, 0, stream.ptr))
            work = timed(kernels)
            back = timed(lambda: _core.prefetch(ptr, GiB, -1, stream.ptr))
            read, total = clock(lambda: float(host[::1024].sum()))
            ok = total == 1024.0 * (N // 1024)
            if advice == "drop":
                advised += clock(lambda: _advise(ptr, _ADVICE[advice]))[0]
            steal1, sched1 = _steal(cpu), _sched()
            dma = timed(lambda: rt.memcpyAsync(pinned.ptr, device.data.ptr, GiB, rt.memcpyDefault, stream.ptr))
            mine = "-" if steal0[1] is None else steal1[1] - steal0[1]
            print(f"{rep:3d} {there:6.1f} {work:7.1f} {back:6.1f} {read:5.1f} {there + work + back + read:6.1f} "
                  f"{advised:6.1f} {dma:6.1f} | {steal1[0] - steal0[0]:3d}, {mine:>3} | {(sched1[0] - sched0[0]) / 1e6:6.1f}, "
                  f"{(sched1[1] - sched0[1]) / 1e6:5.1f}{'' if ok else '  WRONG VALUES'}", flush=True)
    finally:
        del gpu
        rt.free(ptr)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] not in _ADVICE:
        sys.exit(f"ADVICE is one of {', '.join(_ADVICE)}, not {sys.argv[3]!r}")
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20, int(sys.argv[2]) if len(sys.argv) > 2 else -1,
         sys.argv[3] if len(sys.argv) > 3 else "none")
