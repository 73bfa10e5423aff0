"""CuPy's side: ump's arena as CuPy's allocator, and the zero-copy paths.

CuPy's built-in UMP path (``CUPY_ENABLE_UMP=1``) is gated on pageable memory
access and then asserts, so on every machine without SAM it breaks
``cupy.array``. ump therefore imports CuPy with that path off and supplies
the zero-copy conversions itself, the same way on every machine:

- NumPy -> CuPy: ``cupy._core.array`` (behind ``cupy.array``/``asarray``)
  wraps a NumPy array whose memory is a live GPU-visible ump block as a CuPy
  array at the same address; ``copy=True`` copies on the GPU.
- CuPy -> NumPy: ``cupy.ndarray.get`` (behind ``cupy.asnumpy``) and
  ``cupy.ndarray.__array_interface__`` (behind ``numpy.asarray``) return a
  NumPy view of the same memory, after the GPU work is finished.

Anything else (lists, memory ump does not own, layouts CuPy cannot take)
goes through CuPy's own code and is copied as usual.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import numpy

from . import _core
from ._errors import OutOfMemoryError, UmpError

__all__ = ["import_cupy", "CupyHook", "GPU_KINDS", "advice_code"]

#: What migrating managed memory to the GPU and back costs, per byte: 21 ms
#: and 109 ms per GiB measured on an H200 over PCIe (docs/backends.md).
MIGRATION_SECONDS_PER_BYTE = 0.130 / 2**30

#: Kinds whose blocks a kernel can use at their host address.
GPU_KINDS = frozenset({"system", "managed", "pinned"})

_ADVICE = {
    "read_mostly": 1, "unset_read_mostly": 2,
    "preferred_location": 3, "unset_preferred_location": 4,
    "accessed_by": 5, "unset_accessed_by": 6,
}


_imported_by_ump = False


def _builtin_ump_active(cupy) -> bool:
    """Whether CuPy was imported with its UMP path on: only then does it give
    plain host memory a device id (cupy/cuda/memory.pyx, UnownedMemory)."""
    import ctypes

    buf = ctypes.create_string_buffer(512)
    mem = cupy.cuda.memory.UnownedMemory(ctypes.addressof(buf), len(buf), buf)
    return mem.device_id >= 0


def import_cupy(sam: bool):
    """Import CuPy for ump, with CuPy's own UMP path off.

    Raises
    ------
    UmpError
        CuPy was already imported with ``CUPY_ENABLE_UMP=1`` on a machine
        without SAM, where its built-in path raises AssertionError.
    """
    global _imported_by_ump
    if "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        if not (_imported_by_ump or sam) and _builtin_ump_active(cupy):
            raise UmpError(
                "CuPy was imported with CUPY_ENABLE_UMP=1 before ump.enable(); on a GPU "
                "without HMM/ATS CuPy's built-in UMP path fails (AssertionError in "
                "cupy.array). Call ump.enable() before importing cupy."
            )
        return cupy
    saved = os.environ.pop("CUPY_ENABLE_UMP", None)
    try:
        import cupy

        _imported_by_ump = True
    finally:
        if saved is not None:
            os.environ["CUPY_ENABLE_UMP"] = saved
    return cupy


def _extent(ptr: int, shape, strides, itemsize: int) -> tuple[int, int]:
    lo = hi = ptr
    for n, s in zip(shape, strides):
        if n == 0:
            return ptr, ptr
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def _block_of(ptr: int, shape, strides, itemsize: int, kinds=GPU_KINDS):
    """(kind, base, size, lo, hi) if the array lies inside one live block of
    one of ``kinds``, else None."""
    kind, base, size = _core.lookup(ptr)
    if kind not in kinds:
        return None
    lo, hi = _extent(ptr, shape, strides, itemsize)
    if lo < base or hi > base + size:
        return None
    return kind, base, size, lo, hi


def _layout_ok(a, order) -> bool:
    """Whether ``a`` already has the memory order ``order`` asks for."""
    if order is None or order in ("K", "k"):
        return True
    flags = a.flags
    return {"C": flags.c_contiguous, "F": flags.f_contiguous,
            "A": flags.c_contiguous or flags.f_contiguous}.get(str(order).upper(), False)


class _Lease:
    """Owner of a CuPy view of NumPy memory. When CuPy drops it, a kernel
    that uses the memory may still be queued; the NumPy array is kept until
    an event recorded on the current stream has passed, so NumPy cannot free
    the block and hand it out again under the kernel."""

    __slots__ = ("array", "hook")

    def __init__(self, array, hook):
        self.array = array
        self.hook = hook

    def __del__(self):
        hook = self.hook
        try:
            hook.defer(self.array)
        except Exception:  # interpreter shutdown: nothing runs any more
            pass


class _Chunk:
    """Owner of a block CuPy's pool took from the arena."""

    __slots__ = ("ptr", "runtime")

    def __init__(self, ptr, runtime):
        self.ptr = ptr
        self.runtime = runtime

    def __del__(self):
        # CuPy's pool lets go of a block only in free_all_blocks(), and
        # assumes the free synchronises like cudaFree: a kernel may still
        # use it, and NumPy could be handed the block next.
        try:
            self.runtime.deviceSynchronize()
        except Exception:
            pass
        _core._arena_free(self.ptr)


class _Export:
    """What NumPy wraps: the interface of a CuPy array's memory, holding it."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface, owner):
        self.__array_interface__ = interface
        self.owner = owner


class CupyHook:
    """Everything ump changes in CuPy while enabled, and how to undo it."""

    def __init__(self, cupy, backend, arena, options, pool=None):
        self.cupy = cupy
        self.backend = backend
        self.arena = arena
        self.options = options
        self.device = options.device
        # backend "device": a VMM pool, and NumPy <-> CuPy are copies
        self.copies = pool is not None
        self.pool = pool if pool is not None else cupy.cuda.MemoryPool(self._upstream)
        self._pending = collections.deque()
        self._drain_lock = threading.Lock()
        self._placement = {}  # (base, size) -> [on_gpu, heavy, start event]
        self._saved = None

    # --- allocator ----------------------------------------------------------
    # CuPy calls pool.malloc directly (set_allocator), so a CuPy allocation
    # costs what it costs with CuPy's default pool; only a pool miss reaches
    # the arena here.
    def _upstream(self, size):
        cupy = self.cupy
        ptr = _core._arena_alloc(self.arena.id, size)
        if not ptr:
            # What CuPy's pool does on an allocation error, done here so the
            # final error is ump's: release NumPy arrays whose kernels are
            # done and the blocks the pool caches (this runs outside the
            # pool's lock, as CuPy's own retry does), then try once more.
            self.drain(block=True)
            self.pool.free_all_blocks()
            ptr = _core._arena_alloc(self.arena.id, size)
        if not ptr:
            cap = self.arena.statistics().cap_bytes
            raise OutOfMemoryError(
                f"CuPy asked for {size} bytes and the {self.backend.name} backend's cap of "
                f"{cap} bytes is reached (set it with ump.enable(cap=...))",
                _core.error_name(_core.last_status() or _core.ERR_CAP),
            )
        mem = cupy.cuda.memory.UnownedMemory(ptr, size, _Chunk(ptr, cupy.cuda.runtime), self.device)
        return cupy.cuda.memory.MemoryPointer(mem, 0)

    # --- deferred release ---------------------------------------------------
    def defer(self, array):
        event = self.cupy.cuda.Event(block=False, disable_timing=True)
        event.record()
        self._pending.append((event, array))
        if len(self._pending) > 4096:
            self.drain(block=True)

    def drain(self, block=False):
        """Let go of NumPy arrays whose last kernel has finished."""
        if not self._drain_lock.acquire(blocking=block):
            return  # another thread is draining
        try:
            pending = self._pending
            while pending:
                event, _ = pending[0]
                if not block and not event.done:
                    break
                event.synchronize()
                pending.popleft()
        finally:
            self._drain_lock.release()

    def synchronize(self, stream=None):
        if stream is not None and self.options.sync == "stream":
            stream.synchronize()
        else:
            self.cupy.cuda.runtime.deviceSynchronize()
        self.drain()

    # --- placement (managed memory) ----------------------------------------
    # Per block (base, size) of the NumPy arena: [on_gpu, heavy, start event].
    # A block starts host-resident: kernels reach it over the link, which is
    # fastest for work that touches it once. The GPU time between a hand-off
    # and the next host export is measured; once it exceeds what migrating the
    # block there and back would have cost, the block is "heavy" and later
    # hand-offs migrate it (a ski-rental rule). The state is per block, not
    # per array, so a loop that reallocates the same array learns too.
    def on_handoff(self, kind, base, size):
        """A NumPy array's block is handed to CuPy."""
        opts = self.options
        if kind != "managed" or size < opts.prefetch_min or opts.placement == "host":
            return
        state = self._placement.get((base, size))
        if state is None:
            if len(self._placement) >= 4096:
                self._placement.clear()
            state = self._placement[(base, size)] = [False, False, None]
        cupy = self.cupy
        if opts.placement == "migrate" or state[1]:
            if not state[0]:
                _core.prefetch(base, size, self.device, cupy.cuda.get_current_stream().ptr)
                state[0] = True
        elif state[2] is None:
            state[2] = cupy.cuda.Event()
            state[2].record()

    def on_host_export(self, kind, base, size):
        """A block goes back to the host: learn from the GPU time it took, and
        bring it back if ump migrated it."""
        if kind != "managed":
            return
        state = self._placement.get((base, size))
        if state is None:
            return
        cupy = self.cupy
        stream = cupy.cuda.get_current_stream()
        if state[2] is not None:
            end = cupy.cuda.Event()
            end.record(stream)
            end.synchronize()
            gpu_seconds = cupy.cuda.get_elapsed_time(state[2], end) / 1e3
            state[2] = None
            if gpu_seconds > size * MIGRATION_SECONDS_PER_BYTE:
                state[1] = True
        if state[0]:
            _core.prefetch(base, size, -1, stream.ptr)
            stream.synchronize()
            state[0] = False

    # --- NumPy -> CuPy ------------------------------------------------------
    def wrap_host(self, a):
        """A CuPy array at ``a``'s address, or None if ``a`` cannot be shared."""
        if a.size == 0 or not a.flags.writeable:
            return None
        dtype = a.dtype
        if dtype.kind not in "biufc" or not dtype.isnative or dtype.char in "gG":
            return None
        ptr = a.__array_interface__["data"][0]
        if ptr % dtype.itemsize or any(s % dtype.itemsize for s in a.strides):
            return None  # CuPy's kernels assume natural alignment
        found = _block_of(ptr, a.shape, a.strides, dtype.itemsize)
        if found is None:
            return None
        kind, base, size, lo, hi = found
        self.drain()
        self.on_handoff(kind, base, size)
        cupy = self.cupy
        mem = cupy.cuda.memory.UnownedMemory(lo, hi - lo, _Lease(a, self), self.device)
        memptr = cupy.cuda.memory.MemoryPointer(mem, ptr - lo)
        return cupy.ndarray(a.shape, dtype, memptr, a.strides)

    def array(self, obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
        """Stands in for ``cupy._core.array``."""
        original = self._saved["array"]
        if isinstance(obj, numpy.ndarray) and self.copies:
            # A host array always needs a copy here, whatever `copy` says.
            if ndmin <= obj.ndim and (dtype is None or numpy.dtype(dtype) == obj.dtype):
                out = self.copy_in(obj, order)
                if out is not None:
                    return out
        elif isinstance(obj, numpy.ndarray):
            shared = self.wrap_host(obj)
            if shared is not None:
                if (copy is not True and ndmin <= shared.ndim
                        and (dtype is None or numpy.dtype(dtype) == shared.dtype)
                        and _layout_ok(shared, order)):
                    return shared  # the common case: nothing for CuPy to apply
                # dtype, order, ndmin and copy=True are CuPy's to apply to a
                # CuPy array: a view where it can, else a copy on the GPU.
                return original(shared, dtype, copy, order, subok, ndmin, blocking)
        return original(obj, dtype, copy, order, subok, ndmin, blocking)

    def copy_in(self, a, order):
        """Backend "device": a contiguous NumPy array in ump's pinned memory
        is copied by one DMA straight from its memory (CuPy would first copy
        it into a staging buffer). None where CuPy's own path must run."""
        dtype = a.dtype
        if (a.size == 0 or not a.flags.c_contiguous or not _layout_ok(a, order)
                or dtype.kind not in "biufc" or not dtype.isnative or dtype.char in "gG"):
            return None
        ptr = a.__array_interface__["data"][0]
        if _block_of(ptr, a.shape, a.strides, dtype.itemsize, kinds=("pinned",)) is None:
            return None
        cupy = self.cupy
        out = cupy.empty(a.shape, dtype)
        stream = cupy.cuda.get_current_stream()
        out.data.copy_from_host_async(ptr, a.nbytes, stream)
        stream.synchronize()  # the caller may write to `a` as soon as we return
        return out

    # --- CuPy -> NumPy ------------------------------------------------------
    def interface(self, g):
        """The ``__array_interface__`` of a CuPy array in host-visible ump
        memory, or None."""
        if g.size == 0:
            return None
        ptr = g.data.ptr
        found = _block_of(ptr, g.shape, g.strides, g.dtype.itemsize)
        if found is None:
            return None
        return found, {
            "version": 3,
            "shape": g.shape,
            "typestr": g.dtype.str,
            "descr": g.dtype.descr,
            "data": (ptr, False),
            "strides": g.strides,
        }

    def export(self, g, sync=True, stream=None):
        """The array interface of ``g`` for the host, once the GPU is done
        with it (and ump brought it back if ump had migrated it); None if
        ``g`` is not in host-visible ump memory."""
        got = self.interface(g)
        if got is None:
            return None
        (kind, base, size, _, _), iface = got
        if sync:
            self.synchronize(stream)
        self.on_host_export(kind, base, size)
        return iface

    def host_view(self, g, sync=True, stream=None):
        iface = self.export(g, sync, stream)
        return None if iface is None else numpy.asarray(_Export(iface, g))

    def get(self, g, stream=None, order="C", out=None, blocking=True):
        """Stands in for ``cupy.ndarray.get``."""
        if out is None:
            if _layout_ok(g, order):
                view = self.host_view(g, sync=blocking, stream=stream)
                if view is not None:
                    return view
        return self._saved["get"](g, stream=stream, order=order, out=out, blocking=blocking)

    # --- install / uninstall -----------------------------------------------
    def install(self):
        cupy = self.cupy
        hook = self
        saved = {
            "allocator": cupy.cuda.get_allocator(),
            "array": cupy._core.array,
            "get": cupy.ndarray.get,
            # class attributes ump sets on cupy.ndarray, as they were
            "class": {name: cupy.ndarray.__dict__.get(name)
                      for name in ("get", "__array_interface__")},
        }

        def get(self, stream=None, order="C", out=None, blocking=True):
            return hook.get(self, stream=stream, order=order, out=out, blocking=blocking)

        get.__doc__ = saved["get"].__doc__

        def array_interface(self):
            iface = hook.export(self)
            if iface is None:
                raise AttributeError(
                    "__array_interface__: this CuPy array is not in host-visible ump memory")
            return iface

        self._saved = saved
        cupy.cuda.set_allocator(self.pool.malloc)
        cupy._core.array = self.array
        cupy.ndarray.get = get
        cupy.ndarray.__array_interface__ = property(array_interface)

    def uninstall(self):
        cupy, saved = self.cupy, self._saved
        cupy.cuda.set_allocator(saved["allocator"])
        cupy._core.array = saved["array"]
        for name, value in saved["class"].items():
            if value is None:
                delattr(cupy.ndarray, name)
            else:
                setattr(cupy.ndarray, name, value)
        self.synchronize()
        # Blocks CuPy's pool caches go back to the arena; blocks of live
        # arrays stay valid and return when those arrays are freed.
        self.pool.free_all_blocks()


def advice_code(name: str) -> int:
    try:
        return _ADVICE[name]
    except KeyError:
        raise ValueError(f"unknown advice {name!r}; choose one of "
                         + ", ".join(repr(a) for a in _ADVICE)) from None
