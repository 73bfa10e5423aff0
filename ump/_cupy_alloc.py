"""CuPy's allocations under ump: the upstream behind CuPy's pool (the
backend's arena, plain device memory past it where the backend's memory is
the host's, then CuPy's own recovery), and the routing of CuPy's allocator
to that pool, to the device's VMM pool, or through the placement policy.

CuPy's own ``MemoryPool`` stays in front (``set_allocator(pool.malloc)``), so
a CuPy allocation costs what it costs with CuPy's default pool; only a pool
miss reaches :meth:`UnifiedUpstream.__call__`.
"""

from __future__ import annotations

import gc

from . import _core
from ._cupy_compat import OwnWaits, capturing
from ._release import ReleaseQueue

__all__ = ["UnifiedUpstream", "CupyAllocator", "retry_after_recovery"]

#: CuPy blocks of managed memory larger than this are prefetched to the GPU
#: when the arena hands them out: a kernel's first touch of fresh managed
#: memory faults it in at ~100 ms per GiB on an H200, the prefetch populates
#: it in ~5 ms (docs/backends.md). Requests up to this size are slab blocks
#: of the arena, sharing pages that earlier blocks of the slab put there.
POPULATE_MIN_BYTES = 1 << 20

#: cudaErrorMemoryAllocation, the status of CuPy's CUDARuntimeError when
#: cudaMalloc finds no memory (CuPy 14's runtime module does not export the
#: name).
CUDA_ERROR_MEMORY_ALLOCATION = 2


def retry_after_recovery(attempt, free=None):
    """What CuPy's pool does on an allocation error, which code written for
    stock CuPy relies on: ``attempt()`` again after ``free()`` (what can be
    given back now, where there is such a step), then again after
    ``gc.collect()`` and ``free()``: arrays that only reference cycles keep
    alive (a traceback, say) give back their memory once collected. What the
    first attempt that succeeds returns, or None."""
    for collect in (False, True) if free is not None else (True,):
        if collect:
            gc.collect()
        if free is not None:
            free()
        got = attempt()
        if got is not None:
            return got
    return None


class _Chunk:
    """Owner of a block CuPy's pool took from the arena."""

    __slots__ = ("ptr", "runtime", "on_free")

    def __init__(self, ptr, runtime, on_free=None):
        self.ptr = ptr
        self.runtime = runtime
        self.on_free = on_free

    def __del__(self):
        # CuPy's pool lets go of a block only in free_all_blocks(), and
        # assumes the free synchronises like cudaFree: a kernel may still
        # use it, and NumPy could be handed the block next.
        if self.on_free is not None:
            try:
                self.on_free(self.ptr)  # the placement undoes its advice while the block is live
            except Exception:
                pass  # whatever it met, the wait and the free below must happen
        try:
            with OwnWaits():  # the pool's, not the program's
                self.runtime.deviceSynchronize()
        except Exception:
            pass
        _core._arena_free(self.ptr)


class UnifiedUpstream:
    """What CuPy's pool allocates from: the backend's arena while its budget
    lasts, then, for backends whose memory is host memory (``spill``), plain
    device memory as stock CuPy's (conversions of such arrays copy); on
    exhaustion the recovery CuPy's own pool performs.

    Raises
    ------
    OutOfMemoryError
        ump's class that ``except cupy.cuda.memory.OutOfMemoryError`` also
        catches, naming the backend, its budget and the size.
    """

    def __init__(self, cupy, arena, backend_name: str, release: ReleaseQueue, error_class,
                 spill: bool, device: int = 0, arena_for=None, on_free=None, populate: bool = False):
        self.cupy = cupy
        self.populate = populate  # managed memory: put a large block's pages on the GPU first
        self.prefetch = None  # set by the hook: the placement's prefetch of a CuPy block to its GPU
        self.on_free = on_free  # told the base of each block the pool gives back
        self.spill = spill
        self.arena = arena  # the enabled device's
        self.device = device
        self.arena_for = arena_for  # device -> the arena of another GPU
        self.backend_name = backend_name
        self.release = release
        self.error_class = error_class
        self.pool = None  # set by the hook: the CuPy pool this feeds

    def _try(self, arena, device: int, size: int):
        """(the memory or None, the arena's status: ump's or CUDA's, 0 if it allocated)."""
        cuda = self.cupy.cuda
        ptr = _core._arena_alloc(arena.id, size)
        if ptr:
            if self.populate and size > POPULATE_MIN_BYTES:
                self._to_gpu(ptr, size, device)
            mem = cuda.memory.UnownedMemory(ptr, size, _Chunk(ptr, cuda.runtime, self.on_free), device)
            return cuda.memory.MemoryPointer(mem, 0), 0
        status = _core.last_status()  # per thread: read before anything else allocates
        if not self.spill:
            return None, status
        try:
            return cuda.memory.MemoryPointer(cuda.memory.Memory(size), 0), status
        except cuda.runtime.CUDARuntimeError as err:
            # cudaMalloc found no memory: the status CuPy's own pool retries on
            if err.status != CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            return None, status

    def _to_gpu(self, ptr: int, size: int, device: int) -> None:
        """Prefetch a block CuPy is about to write to ``device`` (the current
        one), through the placement's prefetch: on the current stream, which
        orders it before the kernel; not while a graph is captured (that
        would invalidate the capture) nor where the block would not fit on
        the GPU. Never at the cost of the allocation: the kernel's faults do
        the same."""
        if self.prefetch is None:
            return
        try:
            self.prefetch(ptr, size, device)
        except (RuntimeError, OSError):  # UmpError names the CUDA error; the faults stand in
            pass

    def __call__(self, size: int):
        device = self.cupy.cuda.runtime.getDevice()  # CuPy's pool asks on its own device
        arena = self.arena if device == self.device or self.arena_for is None else self.arena_for(device)
        statuses = []

        def attempt():
            got, status = self._try(arena, device, size)
            statuses.append(status)
            return got

        # While a graph is captured the cached blocks stay: freeing a chunk
        # waits for the device, which would invalidate the capture.
        free_cached = not capturing(self.cupy)

        def free():
            self.release.drain()  # NumPy arrays whose kernels are done
            if free_cached:
                self.pool.free_all_blocks()

        # CuPy's recovery done here, so the final error is ump's; it runs
        # outside the pool's lock, as CuPy's own retry does.
        got = attempt()
        if got is None:
            got = retry_after_recovery(attempt, free)
        if got is not None:
            return got
        status = statuses[-1]
        stats = arena.statistics()
        raise self.error_class(
            f"CuPy asked for {size} bytes: the {self.backend_name} backend's budget of "
            f"{stats.cap_bytes} bytes holds {stats.held_bytes}"
            + (" and the device has no memory left" if self.spill else "")
            + " (set the budget with ump.enable(cap=..., headroom=...))",
            _core.error_name(status or _core.ERR_CAP), size, stats.held_bytes, stats.cap_bytes)


class CupyAllocator:
    """Where CuPy's allocations go while ump is enabled: CuPy's own
    ``MemoryPool`` over :class:`UnifiedUpstream` (the backend's arena), or,
    with backend ``"device"``, the VMM pool of the device CuPy is on; through
    the placement policy while it watches for a block's reuse."""

    def __init__(self, cupy, backend, arena, device: int, release: ReleaseQueue, error_class,
                 pool=None, pool_for=None, arena_for=None):
        self.cupy = cupy
        self.device = device
        self.vmm = pool is not None  # backend "device": a VMM pool per device
        self.pool_for = pool_for  # device -> the VMM pool of another device
        self.placement = None  # told of CuPy's blocks: see follow()
        self._upstream = None
        if pool is None:
            self._upstream = UnifiedUpstream(cupy, arena, backend.name, release, error_class,
                                             spill=backend.spills_to_device, device=device,
                                             arena_for=arena_for,
                                             populate=backend.provider == _core.PROVIDER_MANAGED)
            pool = self._upstream.pool = cupy.cuda.MemoryPool(self._upstream)
        self.pool = pool
        self.saved = None  # the allocator CuPy had

    def follow(self, placement) -> None:
        """Tell ``placement`` of the blocks CuPy's pool gives back, and of
        CuPy's allocations while it watches (:meth:`watch`)."""
        self.placement = placement
        if self._upstream is not None:
            self._upstream.on_free = placement.on_block_freed
            self._upstream.prefetch = placement.prefetch_here

    def install(self) -> None:
        self.saved = self.cupy.cuda.get_allocator()
        self.cupy.cuda.set_allocator(self._malloc_on_current_device if self.vmm else self.pool.malloc)

    def restore(self) -> None:
        """Put back the allocator CuPy had (nothing, if none was replaced)."""
        if self.saved is not None:
            self.cupy.cuda.set_allocator(self.saved)

    def watch(self, on: bool) -> bool:
        """Route CuPy's allocations through the placement policy (on) or
        straight to the pool (off); answer whether they now go through it.
        An allocator the program set itself is left alone."""
        cuda = self.cupy.cuda
        plain, watched = self.pool.malloc, self.watched_malloc
        target, other = (watched, plain) if on else (plain, watched)
        if cuda.get_allocator() == other:
            cuda.set_allocator(target)
        return cuda.get_allocator() == watched

    def watched_malloc(self, size):
        mem = self.pool.malloc(size)
        self.placement.on_cupy_malloc(mem.ptr, size)
        return mem

    def _malloc_on_current_device(self, size):
        """Backend "device": allocate from the pool of the device CuPy is on
        (CuPy's own MemoryPool is per device inside; a VMM pool is not)."""
        device = self.cupy.cuda.runtime.getDevice()
        pool = self.pool if device == self.device else self.pool_for(device)
        return pool.malloc(size)
