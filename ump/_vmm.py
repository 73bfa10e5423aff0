"""VMM device pools: growable device memory on cuMemCreate / cuMemMap.

A :class:`VMMPool` reserves one large address range on a device and maps
physical memory into it on demand (csrc/vmm.c). It is a drop-in allocator
for CuPy (``cupy.cuda.set_allocator(pool.malloc)``) and what
``ump.enable(backend="device")`` installs. A :class:`MappedMemory` maps
physical memory at an address range of its own: memory shared with other
processes, an alias of a block, a ring buffer, memory striped over devices.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import os
import sys
import threading
import weakref

from . import _core
from ._cupy_compat import out_of_memory_error
from ._errors import OutOfMemoryError, UmpError
from ._resource import Resource
from ._options import check_budget, check_device_index
from ._probe import _call, device_info, probe

__all__ = ["VMMPool", "VMMStatistics", "GrowableBuffer", "MappedMemory", "ViewTimes", "pool_of"]

_pools: dict[int, "VMMPool"] = {}
_pools_lock = threading.Lock()

#: Address space a pool reserves, as a multiple of its device's memory:
#: holes between blocks cost address space only, never physical memory.
RESERVE_FACTOR = 4
MAX_POOLS = _core.MAX_POOLS


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
    ``exports``: handles exported so far. ``stream_bins``: streams whose
    freed blocks wait for reuse on that stream (at most 64: past that the
    pool waits for its devices and pools them).
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
    stream_bins: int


@dataclasses.dataclass(frozen=True)
class ViewTimes:
    """How long making a :class:`MappedMemory` took, step by step, in
    nanoseconds of the process's monotonic clock (each step summed over its
    calls).

    ``reserve_ns``: its address range (``cuMemAddressReserve``);
    ``physical_ns``: its physical memory (``cuMemCreate``; for imported
    memory ``cuMemImportFromShareableHandle``, none for an alias);
    ``map_ns``: the mappings (``cuMemMap``, twice for a ring, once per
    granule for striped memory); ``access_ns``: granting the pool's devices
    access (``cuMemSetAccess``). On an emulated pool the same steps are
    ``mmap`` and ``memfd`` calls.
    """

    reserve_ns: int
    physical_ns: int
    map_ns: int
    access_ns: int


def _cupy():
    cupy = sys.modules.get("cupy")
    if cupy is None:
        from ._cupy_compat import import_cupy

        cupy = import_cupy()
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


def can_access_peer(device: int, peer: int) -> bool:
    """Whether kernels on ``device`` can reach memory of ``peer``."""
    from cuda.bindings import driver

    return bool(_call(driver.cuDeviceCanAccessPeer, device, peer))


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
        self._retained = None  # the device whose primary context the pool holds
        if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, int)
                                    or not 0 < reserve <= 1 << 48):
            raise ValueError(f"reserve must be a positive number of bytes up to 2**48, got {reserve!r}")
        if self.emulated:
            self.device_memory = 16 << 30
            provider = _core.PROVIDER_HOST
        else:
            self.device_memory = self._check_device()
            provider = _core.PROVIDER_DEVICE
        self._limit_arg = limit
        limit_bytes = self._limit_bytes(limit)
        if reserve is None:
            reserve = RESERVE_FACTOR * self.device_memory
        ctx = 0 if self.emulated else self._retain()  # after every check that may raise
        try:
            pool_id = _core.made(_core.vmm_create, f"creating a VMM pool on device {self.device}",
                                 provider, self.device, ctx, reserve, limit_bytes,
                                 reasons={_core.ERR_ARG: f"at most {MAX_POOLS} pools may exist at "
                                                         "once (close() unused ones)"})
        except BaseException:
            self._release()
            raise
        self._id = pool_id
        with _pools_lock:
            _pools[pool_id] = self
        self._closed = False
        self._fast = None  # CuPy's callables, bound at the first malloc
        st = self.statistics()
        self.granularity = st.granularity
        self._range_bytes = st.reserved_bytes  # the main range: no buffer or view yet

    def _check_device(self) -> int:
        """The device's memory in bytes, once it is known to run a pool."""
        caps = probe()
        if not caps.gpu:
            raise UmpError(f"a VMM pool needs a CUDA device ({caps.reason})")
        info = device_info(caps, self.device)
        if not info.vmm_supported:
            raise UmpError(f"{info.name} (device {self.device}) does not support virtual memory management")
        return info.total_memory

    def _retain(self) -> int:
        """Retain the device's primary context for the pool; close() releases it."""
        from cuda.bindings import driver  # importable: the probe found the GPU through it

        _core.cuda_load()
        dev = _call(driver.cuDeviceGet, self.device)
        ctx = _call(driver.cuDevicePrimaryCtxRetain, dev)
        self._retained = dev
        return int(ctx)

    def _release(self) -> None:
        dev, self._retained = self._retained, None
        if dev is not None:
            from cuda.bindings import driver

            _call(driver.cuDevicePrimaryCtxRelease, dev)

    def _limit_bytes(self, limit) -> int:
        if limit is None:
            return 0
        check_budget("limit", limit)
        return int(limit * self.device_memory) if isinstance(limit, float) else limit

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
        UmpError
            The pool is closed, or was made before ``fork()`` in a child.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"allocation size must be a non-negative int, got {size!r}")
        ptr = _core.vmm_alloc(self.id, size, stream)
        if not ptr:
            raise self._error(_core.last_status(), f"cannot allocate {size} bytes", {
                _core.ERR_RANGE: (f"{size} bytes exceed the reserved address range of "
                                  f"{self._range_bytes} bytes" if size > self._range_bytes else
                                  f"the reserved address range of {self._range_bytes} bytes has no "
                                  f"free {size} bytes left (live blocks fill it; free some, or "
                                  "reserve more)"),
                _core.ERR_FORKED: ("the pool was made before fork(): a child cannot allocate from "
                                   "it (its memory is the parent's); make a pool in the child")})
        return ptr

    def _error(self, status: int, what: str, reasons: dict | None = None) -> Exception:
        """The exception for a status of this pool's C calls: names the pool,
        a closed pool as closed, and the limit where memory ran out."""
        where = "emulated pool" if self.emulated else f"VMM pool on device {self.device}"
        reasons = {_core.ERR_HANDLE: "the pool is closed", **(reasons or {})}
        limit = 0
        if status in _core.OUT_OF_MEMORY and status != _core.ERR_RANGE:
            try:
                limit = self.get_limit()
            except UmpError:  # closed meanwhile
                pass
        what = f"{where}: {what}" + (f" (limit {limit} bytes)" if limit else "")
        return _core.error_for(status, what, reasons.get(status))

    def deallocate(self, ptr: int) -> None:
        """Free a block from :meth:`allocate`; it is reused in stream order."""
        status = _core.vmm_free(self.id, ptr)
        if status:  # ERR_HANDLE: closed by another thread meanwhile; the block went with it
            raise self._error(status, f"freeing {ptr:#x}",
                              {_core.ERR_ARG: f"{ptr:#x} is not a live block of this pool"})

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
        n = _core.made(_core.vmm_devices, "reading the pool's devices", self.id, buf, 16)
        return tuple(buf[:min(n, 16)])

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
            device_info(probe(), device)
            for a, b in ((device, self.device), (self.device, device)):
                if not can_access_peer(a, b):
                    raise UmpError(f"device {a} cannot access memory of device {b} "
                                   "(cuDeviceCanAccessPeer is 0)")
        _core.check(_core.vmm_grant(self.id, device), f"granting device {device} access to the pool")

    def migrate(self, ptr: int, size: int, device: int) -> None:
        """Move the physical memory under ``[ptr, ptr+size)`` to ``device``,
        keeping its addresses: every device of the pool keeps access, and
        the device is granted access first. Whole physical chunks move, so
        neighbouring small blocks in them move too. Waits for every device
        of the pool first: no kernel may use the pages meanwhile."""
        size = _positive(size, "size")
        self.grant(device)
        _core.check(_core.vmm_migrate(self.id, ptr, size, device),
                    f"migrating {size} bytes at {ptr:#x} to device {device}")

    def device_of(self, ptr: int, size: int = 1) -> int:
        """The device whose memory backs ``[ptr, ptr+size)``; -1 if mixed."""
        size = _positive(size, "size")
        return _core.made(_core.vmm_device_of, f"finding the device of [{ptr:#x}, +{size})", self.id,
                          ptr, size, reasons={_core.ERR_ARG: "not mapped memory of this pool"})

    # --- views: a second address range over physical memory ---------------------
    def _view(self, kind: str, what: str, make, *args, size: int, nbytes: int | None = None,
              reasons: dict | None = None, alias=None) -> "MappedMemory":
        """A view made by the C function ``make(pool, *args, &view)``, as a
        MappedMemory of ``nbytes`` (default ``size``) from its start (an
        alias: from ``alias.value``, where C wrote the aliased pointer)."""
        view = ctypes.c_int()
        status = make(self.id, *args, ctypes.byref(view))
        if status:
            raise self._error(status, what, reasons)
        view = view.value
        nbytes = size if nbytes is None else nbytes
        try:
            base, mapped, kind, times = _core.vmm_view(self.id, view)
            ptr = base if alias is None else alias.value
            # Arrays over the view span nbytes from ptr: never past what C
            # mapped, whatever a caller or a peer claimed.
            if not (base <= ptr and ptr + nbytes <= base + mapped):
                raise UmpError(f"{what}: {nbytes} bytes from {ptr:#x} reach past the {mapped} "
                               f"bytes mapped at {base:#x}")
        except BaseException:  # e.g. the pool was closed meanwhile: nothing may keep the view
            _core.vmm_view_destroy(self.id, view)
            raise
        return MappedMemory(self, view, kind, ptr, size, nbytes, mapped, ViewTimes(**times))

    def allocate_shared(self, size: int) -> "MappedMemory":
        """Memory other processes can map: :meth:`MappedMemory.export` gives
        an :class:`ump.ExportHandle` for :func:`ump.import_handle`.

        It has physical memory of its own (whole granules, created exportable:
        ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``) and an address range of
        its own; it counts against the pool's limit and is never trimmed.

        Raises
        ------
        UmpError
            This platform or driver cannot share memory between processes.
        OutOfMemoryError
            The limit or the device is exhausted.
        """
        from ._share import check_platform

        size = _positive(size, "size")
        check_platform()
        if not self.emulated:
            self._check_shareable()
        return self._view("shared", f"allocating {size} shareable bytes", _core.vmm_shared_create,
                          size, size=size)

    def _check_shareable(self) -> None:
        from cuda.bindings import driver

        dev = _call(driver.cuDeviceGet, self.device)
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        if not _call(driver.cuDeviceGetAttribute, attr, dev):
            raise UmpError(f"device {self.device} cannot export memory as a file descriptor")

    def import_handle(self, handle, *, stream: int = 0) -> "MappedMemory":
        """Map memory another process exported (see :func:`ump.import_handle`)."""
        from ._share import ExportHandle

        if not isinstance(handle, ExportHandle):
            raise TypeError(f"expected an ump.ExportHandle, got {type(handle).__name__}")
        fd = handle._importable_by(self)
        foreign = (f"file descriptor {fd} is not the shareable memory its handle describes: a "
                   "foreign or stale handle")
        mem = self._view("imported", f"importing {handle.nbytes} bytes from pid {handle.pid}",
                         _core.vmm_import, fd, handle.nbytes, handle.device,
                         size=handle.size,  # at most nbytes: _importable_by checked
                         reasons={_core.ERR_HANDLE: foreign,
                                  # the driver maps what it has: less than described
                                  _core.CUDA_ERROR_INVALID_VALUE: foreign + " (or smaller than it "
                                                                            "claims)"})
        # CUDA's IPC handles are for other processes (a memory handle fails
        # to open in its own process; events are not relied on to differ):
        # within one process the exporter's stream order is the caller's.
        if handle.event is not None and not self.emulated and handle.pid != os.getpid():
            from ._share import wait_event

            wait_event(self.device, handle.event, stream)
        return mem

    def alias(self, ptr: int, size: int) -> "MappedMemory":
        """The bytes ``[ptr, ptr+size)`` of a live block at a second address
        (the same physical memory mapped again); ``.ptr`` is where ``ptr``
        appears there.

        Whole physical chunks are mapped (CUDA maps whole handles), so the
        neighbours of the block in them are reachable too. While the alias
        is open the pool keeps those chunks where they are: it neither
        scavenges nor migrates them. Close the alias before freeing the block.

        Notes
        -----
        CUDA does not guarantee coherence between two virtual addresses of the
        same memory within one grid or across concurrent grids: write through
        one address in a kernel, read through the other in a later kernel (or
        after a stream synchronisation).

        Raises
        ------
        ValueError
            ``[ptr, ptr+size)`` is not inside one live block of this pool.
        """
        size = _positive(size, "size")
        out = _core._uptr()
        return self._view("alias", f"aliasing {size} bytes at {ptr:#x}", _core.vmm_alias_create, ptr,
                          size, ctypes.byref(out), size=size, alias=out,
                          reasons={_core.ERR_ARG: f"[{ptr:#x}, +{size}) is not inside one live block "
                                                  "of this pool"})

    def ring(self, size: int) -> "MappedMemory":
        """A ring buffer: ``size`` bytes of physical memory mapped twice, back
        to back, so byte ``i`` and byte ``i + size`` are the same memory and a
        read or write that runs past the end continues at the start, without
        wrapping code. ``size`` must be a multiple of :attr:`granularity`.

        Notes
        -----
        The coherence caveat of :meth:`alias` holds between the two halves.
        """
        size = _positive(size, "size")
        if size % self.granularity:
            raise ValueError(f"a ring's size must be a multiple of the pool's granularity "
                             f"({self.granularity} bytes), got {size}")
        return self._view("ring", f"mapping a ring of {size} bytes", _core.vmm_ring_create, size,
                          size=size, nbytes=2 * size)

    def striped(self, size: int, devices) -> "MappedMemory":
        """``size`` bytes whose granules alternate between the physical memory
        of ``devices`` (granule *g* on ``devices[g % len(devices)]``), every
        device of the pool given access to all of it; the devices are first
        granted access to the pool (:meth:`grant`, which checks peer access
        both ways). :meth:`device_of` tells where each granule lives.
        """
        size = _positive(size, "size")
        devices = [check_device_index(d) for d in devices]
        if not devices or len(devices) > 16:
            raise ValueError(f"give 1 to 16 devices, got {len(devices)}")
        for d in devices:
            self.grant(d)
        arr = (ctypes.c_int * len(devices))(*devices)
        return self._view("striped", f"striping {size} bytes over devices {devices}",
                          _core.vmm_striped_create, size, arr, len(devices), size=size)

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
            reasons = {}
            if status == _core.ERR_ARG:
                st = self.statistics()
                reasons[status] = (f"the pool still has {st.current_count} live block(s), buffers or "
                                   f"{st.views} open view(s); free or close them before close()")
            raise self._error(status, "closing it", reasons)
        self._closed = True
        with _pools_lock:
            _pools.pop(self._id, None)
        self._release()


class GrowableBuffer(Resource):
    """Device memory that grows and shrinks in place: its address never
    changes, because it owns an address range of ``max_bytes`` and maps
    physical chunks behind its end as it grows."""

    def __init__(self, pool: VMMPool, max_bytes: int, size: int = 0):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.pool = pool
        self._buf = _core.made(_core.vmm_buffer_create, f"reserving {max_bytes} bytes for a buffer",
                               pool.id, max_bytes)
        self.ptr = _core.vmm_buffer(pool.id, self._buf)[0]
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
            raise self.pool._error(status, f"resizing a buffer to {nbytes} bytes")

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
        shape, n = _extent(shape, dtype)
        if n > self.size:
            raise ValueError(f"an array of {n} bytes does not fit in the buffer's {self.size} bytes")
        return cupy.ndarray(shape, dtype, self.memptr())

    def close(self) -> None:
        if self._buf is not None:
            _core.check(_core.vmm_buffer_destroy(self.pool.id, self._buf), "releasing a buffer")
            self._buf = None


def _positive(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{what} must be a positive int, got {n!r}")
    return n


def _extent(shape, dtype) -> tuple[tuple[int, ...], int]:
    """(shape as a tuple, bytes an array of it spans), in Python ints: NumPy's
    int64 product wraps (2**62 x 4 bytes reads as 0) and would let an array
    reach past its memory."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(f"a shape's dimensions must be non-negative ints, got {shape!r}")
    return shape, math.prod(shape) * dtype.itemsize


class _Lease:
    """The owner of one array over a view: the view cannot close while one
    is alive, so an array never outlives its mapping."""

    def __init__(self, mem: "MappedMemory", nbytes: int):
        self.mem = mem
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (mem.ptr, False)}


class MappedMemory(Resource):
    """An address range of its own over a pool's physical memory.

    Made by :meth:`VMMPool.allocate_shared` (exportable to other processes),
    :func:`ump.import_handle` (another process's memory), :meth:`VMMPool.alias`,
    :meth:`VMMPool.ring` and :meth:`VMMPool.striped`.

    Attributes
    ----------
    ptr : int
        Its first byte (for an alias, where the aliased ``ptr`` appears).
    size : int
        The bytes asked for; for a ring its capacity.
    nbytes : int
        The bytes addressable from ``ptr``: ``size``, or ``2 * size`` for a ring.
    kind : str
        ``"shared"``, ``"imported"``, ``"alias"``, ``"ring"`` or ``"striped"``.
    setup_times : ViewTimes
        How long each driver step of making it took: for imported memory,
        the import of the handle apart from reserving, mapping and granting
        access.

    Notes
    -----
    Two virtual addresses of the same memory (an alias and its block, the two
    halves of a ring, an exporter's and an importer's mappings) are not kept
    coherent by CUDA within one grid or across concurrent grids: write through
    one in a kernel, read through the other in a later kernel on the same
    stream or after a synchronisation. On the host (the emulated pool) they
    are ordinary shared mappings and always coherent.
    """

    def __init__(self, pool: VMMPool, view: int, kind: str, ptr: int, size: int, nbytes: int,
                 mapped: int, setup_times: ViewTimes):
        self.pool = pool
        self._view = view
        self.kind = kind
        self.ptr = ptr
        self.size = size
        self.nbytes = nbytes
        self.mapped_bytes = mapped
        self.setup_times = setup_times
        self._leases: weakref.WeakSet = weakref.WeakSet()
        self._events = []  # IPC events recorded by export(stream=...), alive until close

    def __repr__(self):
        state = "closed" if self._view is None else f"{self.nbytes} bytes at {self.ptr:#x}"
        return f"<ump.MappedMemory {self.kind}: {state}>"

    @property
    def closed(self) -> bool:
        return self._view is None

    def _check_open(self):
        if self._view is None:
            raise UmpError(f"this {self.kind} memory is closed")

    def array(self, shape=None, dtype="uint8"):
        """An array over the memory from :attr:`ptr`: a NumPy array for an
        emulated pool, a CuPy array on a GPU. ``shape`` defaults to all of
        :attr:`nbytes`. The array keeps this object open."""
        import numpy

        self._check_open()
        dtype = numpy.dtype(dtype)
        if shape is None:
            shape = (self.nbytes // dtype.itemsize,)
        shape, n = _extent(shape, dtype)
        if n > self.nbytes:
            raise ValueError(f"an array of {n} bytes does not fit in {self.nbytes} bytes")
        lease = _Lease(self, n)
        self._leases.add(lease)
        if self.pool.emulated:
            return numpy.asarray(lease).view(dtype).reshape(shape)
        cupy = _cupy()
        mem = cupy.cuda.memory.UnownedMemory(self.ptr, n, lease, self.pool.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.memory.MemoryPointer(mem, 0))

    def device_of(self, offset: int = 0, size: int = 1) -> int:
        """The device whose memory backs ``[ptr+offset, ptr+offset+size)``; -1 if mixed."""
        self._check_open()
        size = _positive(size, "size")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= self.nbytes - size:
            raise ValueError(f"[{offset!r}, +{size}) is not inside this {self.kind} memory's "
                             f"{self.nbytes} bytes")
        return self.pool.device_of(self.ptr + offset, size)

    def export(self, *, stream: int | None = None):
        """An :class:`ump.ExportHandle` for another process: a new file
        descriptor for the physical memory, and what the importer needs to
        map it. Only memory from :meth:`VMMPool.allocate_shared` exports.

        With ``stream`` (GPU), an inter-process event is recorded on it and
        travels with the handle; the importer's stream waits for it, so work
        queued here before the export is ordered before the importer's.

        The physical memory lives while any process maps it or holds a
        handle: closing it here (or this process exiting) leaves importers
        their memory.
        """
        from ._share import ExportHandle, record_event

        self._check_open()
        if self.kind != "shared":
            raise UmpError(f"only memory from allocate_shared() exports, not {self.kind} memory")
        fd = _core._int(-1)
        _core.check(_core.vmm_export(self.pool.id, self._view, ctypes.byref(fd)),
                    "exporting shareable memory")
        # The driver's descriptor would pass to every program this one runs.
        os.set_inheritable(fd.value, False)
        event = None
        if stream is not None and not self.pool.emulated:
            try:
                ev, event = record_event(self.pool.device, stream)
            except BaseException:
                os.close(fd.value)
                raise
            self._events.append(ev)
        return ExportHandle(fd.value, size=self.size, nbytes=self.mapped_bytes,
                            granularity=self.pool.granularity, device=self.pool.device,
                            emulated=self.pool.emulated, event=event)

    def close(self) -> None:
        """Unmap (after waiting for the device) and release what it owns.

        Raises
        ------
        UmpError
            Arrays made by :meth:`array` are still alive.
        """
        if self._view is None:
            return
        alive = len(self._leases)
        if alive:
            raise UmpError(f"{alive} array(s) over this {self.kind} memory are still alive; "
                           "delete them before close()")
        _core.check(_core.vmm_view_destroy(self.pool.id, self._view), f"closing {self.kind} memory")
        self._view = None
        if self._events:
            from ._share import destroy_events

            destroy_events(self.pool.device, self._events)
            self._events = []


def pool_of(ptr: int) -> VMMPool | None:
    """The live pool whose block or buffer holds ``ptr``."""
    kind, _, _, owner = _core.lookup_owner(ptr)
    if kind is None or owner < _core.MAX_ARENAS:
        return None
    return _pools.get(owner - _core.MAX_ARENAS)
