"""VMM device pools: growable device memory on cuMemCreate / cuMemMap.

A :class:`VMMPool` reserves one large address range on a device and maps
physical memory into it on demand (csrc/pool.c and the units under it). It
is a drop-in allocator for CuPy (``cupy.cuda.set_allocator(pool.malloc)``)
and what ``ump.enable(backend="device")`` installs. Its jobs are one class
each: the pool itself (here), CuPy's allocator interface
(ump/_vmm_cupy.py), its devices (here) and its views and buffers
(ump/_views.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading

from . import _core, _driver
from ._errors import UmpError
from ._options import check_budget, check_device_index
from ._probe import device_info, probe
from ._share import ExportHandle
from ._views import GrowableBuffer, MappedMemory, PoolViews, ViewTimes, positive
from ._vmm_cupy import CupyAllocatorInterface

__all__ = ["VMMPool", "VMMStatistics", "GrowableBuffer", "MappedMemory", "ViewTimes", "pool_of",
           "import_handle"]

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



class PoolDevices:
    """The devices of a pool: which may reach its memory, and where each
    granule of it lives (the part of :class:`ump.VMMPool` that says so)."""

    @property
    def devices(self) -> tuple[int, ...]:
        """Devices granted access to the pool's memory (its own first)."""
        most = _core.VMM_MAX_DEVICES
        buf = (ctypes.c_int * most)()
        n = _core.made(_core.vmm_devices, "reading the pool's devices", self.id, buf, most)
        return tuple(buf[:min(n, most)])

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
                if not _driver.can_access_peer(a, b):
                    raise UmpError(f"device {a} cannot access memory of device {b} "
                                   "(cuDeviceCanAccessPeer is 0)")
        _core.check(_core.vmm_grant(self.id, device), f"granting device {device} access to the pool")

    def migrate(self, ptr: int, size: int, device: int) -> None:
        """Move the physical memory under ``[ptr, ptr+size)`` to ``device``,
        keeping its addresses: every device of the pool keeps access, and
        the device is granted access first. Whole physical chunks move, so
        neighbouring small blocks in them move too. Waits for every device
        of the pool first: no kernel may use the pages meanwhile."""
        size = positive(size, "size")
        self.grant(device)
        _core.check(_core.vmm_migrate(self.id, ptr, size, device),
                    f"migrating {size} bytes at {ptr:#x} to device {device}")

    def device_of(self, ptr: int, size: int = 1) -> int:
        """The device whose memory backs ``[ptr, ptr+size)``; -1 if mixed."""
        size = positive(size, "size")
        return _core.made(_core.vmm_device_of, f"finding the device of [{ptr:#x}, +{size})", self.id,
                          ptr, size, reasons={_core.ERR_ARG: "not mapped memory of this pool"})


class VMMPool(CupyAllocatorInterface, PoolDevices, PoolViews):
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
        most = _core.VMM_MAX_RESERVE
        if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, int)
                                    or not 0 < reserve <= most):
            raise ValueError(f"reserve must be a positive number of bytes up to 2**{most.bit_length() - 1}, "
                             f"got {reserve!r}")
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
        ctx = _driver.retain(self.device)
        self._retained = self.device
        return ctx

    def _release(self) -> None:
        device, self._retained = self._retained, None
        if device is not None:
            _driver.release(device)

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


def pool_of(ptr: int) -> VMMPool | None:
    """The live pool whose block or buffer holds ``ptr``."""
    kind, _, _, owner = _core.lookup_owner(ptr)
    if kind is None or owner < _core.MAX_ARENAS:
        return None
    return _pools.get(owner - _core.MAX_ARENAS)


_importers: dict = {}
_importers_lock = threading.Lock()


def _forget_importers() -> None:
    """In a forked child: the parent's pools refuse to map (csrc/pool.c), so
    the child's imports get pools of their own."""
    global _importers_lock
    _importers.clear()
    _importers_lock = threading.Lock()  # another thread may have held it at fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_importers)


def import_handle(handle: ExportHandle, pool=None, *, stream: int = 0) -> MappedMemory:
    """Map memory another process exported; returns a :class:`MappedMemory`
    whose :meth:`~MappedMemory.array` is a NumPy array (emulated) or a CuPy
    array (GPU) over the same physical memory.

    Parameters
    ----------
    handle : ExportHandle
        From :meth:`MappedMemory.export`, received through multiprocessing or
        a :class:`Connection`. It stays open: close it after importing.
    pool : VMMPool, optional
        The pool that maps it (its address range, device access list).
        Default: one importing pool per device (or one emulated pool) for the
        process, made at first use.
    stream : int
        GPU: the stream that waits for the exporter's event, if it sent one.

    Raises
    ------
    UmpError
        The handle is closed, was exported by a pool of another kind or
        granularity, or its file descriptor is not the shareable memory it
        describes (a foreign or stale handle).
    """
    if not isinstance(handle, ExportHandle):
        raise TypeError(f"expected an ump.ExportHandle, got {type(handle).__name__}")
    if pool is None:
        handle._check()  # a lying handle makes no pool
        key = ("emulated", 0) if handle.emulated else ("device", handle.device)
        with _importers_lock:
            pool = _importers.get(key)
            if pool is None or pool._closed:
                # The main range serves no blocks: one granule (whatever the
                # handle says the granularity is) reserved.
                pool = _importers[key] = VMMPool(key[1], emulate=handle.emulated, reserve=1)
    return pool.import_handle(handle, stream=stream)
