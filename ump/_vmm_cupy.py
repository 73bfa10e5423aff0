"""CuPy's allocator interface of a VMM pool (``cupy.cuda.set_allocator(
pool.malloc)``): what CuPy's own ``MemoryPool`` offers, over the pool's
blocks in stream order."""

from __future__ import annotations

from . import _core
from ._cupy_alloc import retry_after_recovery
from ._cupy_compat import cupy_module as _cupy
from ._cupy_compat import out_of_memory_error
from ._errors import OutOfMemoryError

__all__ = ["CupyAllocatorInterface"]


class _Block:
    """Owner of one pool block under a CuPy array: frees it when CuPy lets go.

    The block returns to the bins of the stream it was allocated on, so it is
    reused only by later work on that stream (see csrc/block.c)."""

    __slots__ = ("pool", "ptr")

    def __init__(self, pool: int, ptr: int):
        self.pool = pool
        self.ptr = ptr

    def __del__(self):
        _core.vmm_free(self.pool, self.ptr)


class CupyAllocatorInterface:
    """The part of :class:`ump.VMMPool` that CuPy calls: ``malloc``,
    ``free_all_blocks``, ``used_bytes``, ``total_bytes``, ``free_bytes``,
    ``set_limit``, ``get_limit``, as on ``cupy.cuda.MemoryPool``."""

    def malloc(self, size: int):
        """CuPy's allocator hook: a ``MemoryPointer`` to ``size`` bytes on the
        current stream."""
        fast = self._fast
        if fast is None:
            cupy = _cupy()
            fast = self._fast = (cupy.cuda.get_current_stream, cupy.cuda.memory.UnownedMemory,
                                 cupy.cuda.memory.MemoryPointer, cupy.cuda.memory.Memory)
        current_stream, unowned, memptr, memory = fast
        if size == 0:  # as CuPy's pools: a null pointer, no block
            return memptr(memory(0), 0)
        pool = self._id
        stream = current_stream().ptr
        ptr = _core.vmm_alloc(pool, size, stream) if not self._closed else 0
        if not ptr:
            ptr = self._allocate_or_recover(size, stream)
        return memptr(unowned(ptr, size, _Block(pool, ptr), self.device), 0)

    def _allocate_or_recover(self, size: int, stream: int) -> int:
        """A block after CuPy's recovery, or the class CuPy users catch
        (``cupy.cuda.memory.OutOfMemoryError``) naming why there is none."""
        failed = []

        def attempt():
            try:
                return self.allocate(size, stream)  # raises the precise error
            except OutOfMemoryError as err:
                failed.append(err)
                return None

        ptr = attempt()
        if ptr is None:
            ptr = retry_after_recovery(attempt)
        if ptr is None:
            err = failed[-1]
            cls = out_of_memory_error(_cupy())
            raise cls(err.message, err.cuda_error, size, self.used_bytes(), self.get_limit()) from None
        return ptr

    def free_all_blocks(self, stream=None) -> None:
        """Give back all memory no block uses (CuPy's name for :meth:`trim`)."""
        self.trim()

    def used_bytes(self) -> int:
        st = self.statistics()
        return st.used_bytes + st.buffer_bytes

    def total_bytes(self) -> int:
        return self.statistics().physical_bytes

    def free_bytes(self) -> int:
        st = self.statistics()
        return max(st.physical_bytes - st.used_bytes - st.buffer_bytes, 0)

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        """Cap the physical memory the pool holds, like CuPy's
        ``MemoryPool.set_limit``; no arguments (or 0) remove the cap."""
        if size is not None and fraction is not None:
            raise ValueError("give size or fraction, not both")
        limit = self._limit_bytes(fraction if fraction else size)
        _core.check(_core.vmm_set_limit(self.id, limit), "setting the pool's limit")

    def get_limit(self) -> int:
        return self.statistics().limit_bytes
