"""Views: address ranges of their own over a VMM pool's physical memory.

A :class:`MappedMemory` maps physical memory at an address range of its own:
memory shared with other processes (exported as a file descriptor, imported
there), an alias of a block, a ring buffer mapped twice back to back, memory
striped over devices. A :class:`GrowableBuffer` grows and shrinks in place.
:class:`PoolViews` is the part of :class:`ump.VMMPool` that makes them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import weakref

from . import _core, _driver
from ._cupy_compat import cupy_module as _cupy
from ._errors import UmpError
from ._options import check_device_index
from ._resource import Resource
from ._share import ExportHandle, check_platform

__all__ = ["PoolViews", "MappedMemory", "GrowableBuffer", "ViewTimes", "positive"]


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


class PoolViews:
    """Making views and buffers of a pool (the part of :class:`ump.VMMPool`
    that does it)."""

    def _view(self, what: str, make, *args, size: int, nbytes: int | None = None,
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
        size = positive(size, "size")
        check_platform()
        if not self.emulated and not _driver.exports_fds(self.device):
            raise UmpError(f"device {self.device} cannot export memory as a file descriptor")
        return self._view(f"allocating {size} shareable bytes", _core.vmm_shared_create,
                          size, size=size)

    def import_handle(self, handle, *, stream: int = 0) -> "MappedMemory":
        """Map memory another process exported (see :func:`ump.import_handle`)."""
        if not isinstance(handle, ExportHandle):
            raise TypeError(f"expected an ump.ExportHandle, got {type(handle).__name__}")
        fd = handle._importable_by(self)
        foreign = (f"file descriptor {fd} is not the shareable memory its handle describes: a "
                   "foreign or stale handle")
        mem = self._view(f"importing {handle.nbytes} bytes from pid {handle.pid}",
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
            _driver.wait_event(self.device, handle.event, stream)
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
        size = positive(size, "size")
        out = _core._uptr()
        return self._view(f"aliasing {size} bytes at {ptr:#x}", _core.vmm_alias_create, ptr,
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
        size = positive(size, "size")
        if size % self.granularity:
            raise ValueError(f"a ring's size must be a multiple of the pool's granularity "
                             f"({self.granularity} bytes), got {size}")
        return self._view(f"mapping a ring of {size} bytes", _core.vmm_ring_create, size,
                          size=size, nbytes=2 * size)

    def striped(self, size: int, devices) -> "MappedMemory":
        """``size`` bytes whose granules alternate between the physical memory
        of ``devices`` (granule *g* on ``devices[g % len(devices)]``), every
        device of the pool given access to all of it; the devices are first
        granted access to the pool (:meth:`grant`, which checks peer access
        both ways). :meth:`device_of` tells where each granule lives.
        """
        size = positive(size, "size")
        devices = [check_device_index(d) for d in devices]
        if not 0 < len(devices) <= _core.VMM_MAX_DEVICES:
            raise ValueError(f"give 1 to {_core.VMM_MAX_DEVICES} devices, got {len(devices)}")
        for d in devices:
            self.grant(d)
        arr = (ctypes.c_int * len(devices))(*devices)
        return self._view(f"striping {size} bytes over devices {devices}",
                          _core.vmm_striped_create, size, arr, len(devices), size=size)

    # --- growable buffers ----------------------------------------------------------
    def buffer(self, max_bytes: int, size: int = 0) -> "GrowableBuffer":
        """A buffer that grows in place up to ``max_bytes``, keeping its address."""
        return GrowableBuffer(self, max_bytes, size)


class GrowableBuffer(Resource):
    """Device memory that grows and shrinks in place: its address never
    changes, because it owns an address range of ``max_bytes`` and maps
    physical chunks behind its end as it grows."""

    def __init__(self, pool, max_bytes: int, size: int = 0):
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


def positive(n, what: str) -> int:
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

    def __init__(self, pool, view: int, kind: str, ptr: int, size: int, nbytes: int,
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
        size = positive(size, "size")
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
                ev, event = _driver.record_event(self.pool.device, stream)
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
            _driver.destroy_events(self.pool.device, self._events)
            self._events = []
