"""VMM device pools: growable device memory on cuMemCreate / cuMemMap.

A :class:`VMMPool` reserves one large address range on a device and maps
physical memory into it on demand (csrc/vmm.c). It is a drop-in allocator
for CuPy (``cupy.cuda.set_allocator(pool.malloc)``) and what
``ump.enable(backend="device")`` installs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import sys
import threading

from . import _core
from ._cupy_compat import out_of_memory_error
from ._errors import OutOfMemoryError, UmpError
from ._probe import _call, check_device_index, device_info, probe

__all__ = ["VMMPool", "VMMStatistics", "GrowableBuffer", "pool_of"]

_pools: dict[int, "VMMPool"] = {}
_pools_lock = threading.Lock()

#: Address space a pool reserves, as a multiple of its device's memory:
#: holes between blocks cost address space only, never physical memory.
RESERVE_FACTOR = 4
MAX_POOLS = 16  # UMP_MAX_POOLS in csrc/ump.h


@dataclasses.dataclass(frozen=True)
class VMMStatistics:
    """What a :class:`VMMPool` holds and hands out (bytes and counts).

    ``used``: blocks handed out (512-byte multiples); ``buffer``: growable
    buffers; ``reserved``: address space; ``mapped``: physical memory mapped
    into it; ``physical``: physical memory held (mapped + cached handles);
    ``idle``: mapped but touched by no live block. ``peak_*`` are high-water
    marks, ``total_*`` sums over the pool's life. Views (:class:`MappedMemory`):
    ``view``: address space they map; ``shared``: physical memory they own
    (part of ``physical``); ``imported``: other processes' memory mapped
    here (not part of ``physical``); ``views``: how many are open;
    ``exports``: handles exported so far.
    """

    used_bytes: int
    peak_used_bytes: int
    total_bytes: int
    current_count: int
    peak_count: int
    total_count: int
    buffer_bytes: int
    reserved_bytes: int
    mapped_bytes: int
    peak_mapped_bytes: int
    physical_bytes: int
    peak_physical_bytes: int
    cached_bytes: int
    idle_bytes: int
    limit_bytes: int
    granularity: int
    handles: int
    handles_created: int
    handles_released: int
    maps: int
    unmaps: int
    rollbacks: int
    migrations: int
    failures: int
    bad_frees: int
    view_bytes: int
    shared_bytes: int
    imported_bytes: int
    views: int
    exports: int


def _cupy():
    cupy = sys.modules.get("cupy")
    if cupy is None:
        from ._cupy_hook import import_cupy

        cupy = import_cupy(sam=False)
    return cupy


class _Block:
    """Owner of one pool block under a CuPy array: frees it when CuPy lets go.

    The block returns to the bins of the stream it was allocated on, so it is
    reused only by later work on that stream (see csrc/vmm.c)."""

    __slots__ = ("pool", "ptr")

    def __init__(self, pool: int, ptr: int):
        self.pool = pool
        self.ptr = ptr

    def __del__(self):
        _core.vmm_free(self.pool, self.ptr)


class VMMPool:
    """A device-memory pool on CUDA's virtual memory management API.

    Parameters
    ----------
    device : int
        The CUDA device whose memory the pool maps.
    limit : int or float, optional
        Most physical bytes the pool may hold (int), or a fraction in (0, 1]
        of the device's memory. Default: no limit but the device's.
    reserve : int, optional
        Bytes of address space to reserve (default four times the device's
        memory). Blocks never move, so this bounds the pool's span.
    emulate : bool
        Run the same pool on host memory (memfd mappings) instead of a GPU:
        for tests and machines without one; its blocks' kind is ``"host"``.

    Notes
    -----
    The pool implements CuPy's allocator interface (``malloc``,
    ``free_all_blocks``, ``used_bytes``, ``total_bytes``, ``free_bytes``,
    ``set_limit``, ``get_limit``): ``cupy.cuda.set_allocator(pool.malloc)``.
    """

    def __init__(self, device: int = 0, *, limit: int | float | None = None,
                 reserve: int | None = None, emulate: bool = False):
        self.device = check_device_index(device)
        self.emulated = bool(emulate)
        if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, int)
                                    or not 0 < reserve <= 1 << 48):
            raise ValueError(f"reserve must be a positive number of bytes up to 2**48, got {reserve!r}")
        if self.emulated:
            ctx, self.device_memory = 0, 16 << 30
            provider = _core.PROVIDER_HOST
        else:
            ctx, self.device_memory = self._open_device()
            provider = _core.PROVIDER_DEVICE
        self._limit_arg = limit
        limit_bytes = self._limit_bytes(limit)
        if reserve is None:
            reserve = RESERVE_FACTOR * self.device_memory
        pool_id = _core.vmm_create(provider, self.device, ctx, reserve, limit_bytes)
        if pool_id < 0:
            status = _core.last_status() or -5
            hint = (f": at most {MAX_POOLS} pools may exist at once (close() unused ones)"
                    if status == -5 else "")
            _core.check(status, f"creating a VMM pool on device {self.device}{hint}")
        self._id = pool_id
        with _pools_lock:
            _pools[pool_id] = self
        self._closed = False
        self._fast = None  # CuPy's callables, bound at the first malloc
        self.granularity = self.statistics().granularity

    def _open_device(self) -> tuple[int, int]:
        caps = probe()
        if not caps.gpu:
            raise UmpError(f"a VMM pool needs a CUDA device ({caps.reason})")
        from cuda.bindings import driver  # importable: the probe found the GPU through it

        info = device_info(caps, self.device)
        if not info.vmm_supported:
            raise UmpError(f"{info.name} (device {self.device}) does not support virtual memory management")
        _core.cuda_load()
        dev = _call(driver.cuDeviceGet, self.device)
        ctx = _call(driver.cuDevicePrimaryCtxRetain, dev)
        return int(ctx), info.total_memory

    def _limit_bytes(self, limit) -> int:
        if limit is None:
            return 0
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise TypeError(f"limit must be an int (bytes) or a float fraction, not {type(limit).__name__}")
        if isinstance(limit, float):
            if not 0.0 < limit <= 1.0:
                raise ValueError(f"limit as a fraction must be in (0, 1], got {limit}")
            return int(limit * self.device_memory)
        if not 0 <= limit < 1 << 63:
            raise ValueError(f"limit must be a non-negative number of bytes below 2**63, got {limit}")
        return limit

    @property
    def id(self) -> int:
        if self._closed:
            raise UmpError("this VMM pool is closed")
        return self._id

    def __repr__(self):
        if self._closed:
            return "<ump.VMMPool (closed)>"
        st = self.statistics()
        where = "emulated" if self.emulated else f"device {self.device}"
        return (f"<ump.VMMPool {where}: used {st.used_bytes} B, physical {st.physical_bytes} B, "
                f"reserved {st.reserved_bytes} B>")

    # --- raw blocks ------------------------------------------------------------
    def allocate(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes in stream order on ``stream`` (a CUDA stream
        handle, 0 for the legacy default stream); returns the address.

        Raises
        ------
        OutOfMemoryError
            The limit, the device or the address range is exhausted.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"allocation size must be a non-negative int, got {size!r}")
        ptr = _core.vmm_alloc(self.id, size, stream)
        if not ptr:
            status = _core.last_status()
            name = _core.error_name(status)
            where = "emulated pool" if self.emulated else f"VMM pool on device {self.device}"
            if status == -5:  # UMP_ERR_ARG: larger than the reservation
                raise OutOfMemoryError(f"{where}: {size} bytes exceed the reserved address range "
                                       f"of {self.statistics().reserved_bytes} bytes", name)
            limit = self.get_limit()
            detail = f" (limit {limit} bytes)" if limit else ""
            raise OutOfMemoryError(f"{where}: cannot allocate {size} bytes{detail}", name)
        return ptr

    def deallocate(self, ptr: int) -> None:
        """Free a block from :meth:`allocate`; it is reused in stream order."""
        status = _core.vmm_free(self.id, ptr)
        if status:
            raise ValueError(f"{ptr:#x} is not a live block of this pool")

    # --- CuPy's allocator interface ----------------------------------------------
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
            try:
                ptr = self.allocate(size, stream)  # raises the precise error
            except OutOfMemoryError:
                # What CuPy's pools do before giving up: arrays that only a
                # reference cycle (a traceback, say) keeps alive give back
                # their blocks once collected.
                gc.collect()
                try:
                    ptr = self.allocate(size, stream)
                except OutOfMemoryError as err:
                    # the class CuPy users catch (cupy.cuda.memory.OutOfMemoryError)
                    cls = out_of_memory_error(_cupy())
                    raise cls(err.message, err.cuda_error, size, self.used_bytes(),
                              self.get_limit()) from None
        return memptr(unowned(ptr, size, _Block(pool, ptr), self.device), 0)

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

    # --- memory back to the driver -----------------------------------------------
    def trim(self, keep_handles: bool = False) -> int:
        """Unmap physical memory no live block touches and release it to the
        driver; with ``keep_handles`` keep it cached for the next growth.
        Waits for the device first. Returns the bytes released (unmapped,
        with ``keep_handles``)."""
        before = self.statistics()
        _core.check(_core.vmm_trim(self.id, int(bool(keep_handles))), "trimming the pool")
        after = self.statistics()
        if keep_handles:
            return before.mapped_bytes - after.mapped_bytes
        return before.physical_bytes - after.physical_bytes

    def statistics(self) -> VMMStatistics:
        out = _core._CVmmStats()
        _core.check(_core.vmm_stats(self.id, ctypes.byref(out)), "reading pool statistics")
        return VMMStatistics(**{name: getattr(out, name) for name, _ in _core._CVmmStats._fields_})

    # --- devices -----------------------------------------------------------------
    @property
    def devices(self) -> tuple[int, ...]:
        """Devices granted access to the pool's memory (its own first)."""
        buf = (ctypes.c_int * 16)()
        n = _core.vmm_devices(self.id, buf, 16)
        return tuple(buf[:n])

    def grant(self, device: int) -> None:
        """Let kernels on ``device`` use the pool's memory at the same
        addresses (cuMemSetAccess; no cudaDeviceEnablePeerAccess needed).

        Raises
        ------
        ValueError
            The device does not exist.
        UmpError
            The devices cannot reach each other's memory.
        """
        check_device_index(device)
        if not self.emulated and device != self.device:
            from cuda.bindings import driver

            device_info(probe(), device)
            for a, b in ((device, self.device), (self.device, device)):
                if not _call(driver.cuDeviceCanAccessPeer, a, b):
                    raise UmpError(f"device {a} cannot access memory of device {b} "
                                   "(cuDeviceCanAccessPeer is 0)")
        _core.check(_core.vmm_grant(self.id, device), f"granting device {device} access to the pool")

    def _synchronize_devices(self) -> None:
        if self.emulated:
            return
        from cuda.bindings import driver

        for d in self.devices:
            dev = _call(driver.cuDeviceGet, d)
            ctx = _call(driver.cuDevicePrimaryCtxRetain, dev)
            _call(driver.cuCtxPushCurrent, ctx)
            try:
                _call(driver.cuCtxSynchronize)
            finally:
                _call(driver.cuCtxPopCurrent)
                _call(driver.cuDevicePrimaryCtxRelease, dev)

    def migrate(self, ptr: int, size: int, device: int) -> None:
        """Move the physical memory under ``[ptr, ptr+size)`` to ``device``,
        keeping its addresses: every device of the pool keeps access, and
        the device is granted access first. Whole physical chunks move, so
        neighbouring small blocks in them move too."""
        self.grant(device)
        self._synchronize_devices()  # no kernel on any device may use the pages
        _core.check(_core.vmm_migrate(self.id, ptr, size, device),
                    f"migrating {size} bytes at {ptr:#x} to device {device}")

    def device_of(self, ptr: int, size: int = 1) -> int:
        """The device whose memory backs ``[ptr, ptr+size)``; -1 if mixed."""
        dev = _core.vmm_device_of(self.id, ptr, size)
        if dev < -1:
            raise ValueError(f"[{ptr:#x}, +{size}) is not mapped memory of this pool")
        return dev

    # --- growable buffers ----------------------------------------------------------
    def buffer(self, max_bytes: int, size: int = 0) -> "GrowableBuffer":
        """A buffer that grows in place up to ``max_bytes``, keeping its address."""
        return GrowableBuffer(self, max_bytes, size)

    def close(self) -> None:
        """Release everything; only once no block or buffer is live."""
        if self._closed:
            return
        status = _core.vmm_destroy(self._id)
        if status:
            raise UmpError(f"the pool still has {self.statistics().current_count} live block(s) "
                           "or buffers; free them before close()")
        self._closed = True
        with _pools_lock:
            _pools.pop(self._id, None)


class GrowableBuffer:
    """Device memory that grows and shrinks in place: its address never
    changes, because it owns an address range of ``max_bytes`` and maps
    physical chunks behind its end as it grows."""

    def __init__(self, pool: VMMPool, max_bytes: int, size: int = 0):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.pool = pool
        buf = _core.vmm_buffer_create(pool.id, max_bytes)
        if buf < 0:
            _core.check(_core.last_status() or -5, f"reserving {max_bytes} bytes for a buffer")
        self._buf = buf
        self.ptr = _core.vmm_buffer(pool.id, buf)[0]
        self.max_bytes = max_bytes
        if size:
            self.resize(size)

    @property
    def size(self) -> int:
        return 0 if self._buf is None else _core.vmm_buffer(self.pool.id, self._buf)[1]

    def __len__(self):
        return self.size

    def resize(self, nbytes: int) -> None:
        """Grow (map more chunks) or shrink (unmap whole chunks past the new
        end, after waiting for the device). The contents up to
        ``min(old, new)`` size stay.

        Raises
        ------
        ValueError
            ``nbytes`` is negative or past ``max_bytes``.
        OutOfMemoryError
            The pool's limit or the device ran out; the buffer is unchanged.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= self.max_bytes:
            raise ValueError(f"a buffer of max_bytes={self.max_bytes} cannot be resized to {nbytes!r}")
        status = _core.vmm_buffer_resize(self.pool.id, self._buf, nbytes)
        if status:
            name = _core.error_name(status)
            raise OutOfMemoryError(f"growing a buffer to {nbytes} bytes failed", name)

    def memptr(self):
        """A CuPy ``MemoryPointer`` over the buffer's current size."""
        cupy = _cupy()
        mem = cupy.cuda.memory.UnownedMemory(self.ptr, self.size, self, self.pool.device)
        return cupy.cuda.memory.MemoryPointer(mem, 0)

    def array(self, shape, dtype="float32"):
        """A CuPy array over the start of the buffer."""
        import numpy

        cupy = _cupy()
        dtype = numpy.dtype(dtype)
        n = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
        if n > self.size:
            raise ValueError(f"an array of {n} bytes does not fit in the buffer's {self.size} bytes")
        return cupy.ndarray(shape, dtype, self.memptr())

    def close(self) -> None:
        if self._buf is not None:
            _core.check(_core.vmm_buffer_destroy(self.pool.id, self._buf), "releasing a buffer")
            self._buf = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def pool_of(ptr: int) -> VMMPool | None:
    """The live pool whose block or buffer holds ``ptr``."""
    kind, _, _, owner = _core.lookup_owner(ptr)
    if kind is None or owner < _core.MAX_ARENAS:
        return None
    return _pools.get(owner - _core.MAX_ARENAS)
