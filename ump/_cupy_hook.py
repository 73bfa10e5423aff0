"""CuPy's side while ump is enabled: its allocator, and every way another
library or the host reaches a CuPy array's memory.

The coherence rule (docs/guide.md, "Coherence"): **host code never sees ump
memory before the GPU work queued on it has finished**, and **every consumer
gets a device type it accepts**. CuPy does not record which stream wrote an
array, so every export first waits for the device (``sync="device"``, the
default) or for the stream the caller names (``sync="stream"``):

- NumPy -> CuPy: ``cupy._core.array`` (behind ``cupy.array``/``asarray``)
  wraps a NumPy array whose memory is a live GPU-visible ump block as a CuPy
  array at the same address. A dtype change is NumPy's cast on the host, as
  in stock CuPy, into a new ump block that CuPy then shares.
- CuPy -> host: ``get`` (behind ``cupy.asnumpy``, ``tolist``, printing,
  pickling), ``__array_interface__`` and ``__array__`` (behind
  ``numpy.asarray``/``numpy.array``), ``__buffer__`` (``memoryview``,
  Python >= 3.12), and ``__dlpack__`` asked for the CPU
  (``numpy.from_dlpack``) share host-visible memory after the wait, and copy
  device memory after it; a copy ``get`` makes with CuPy's null stream
  current is itself the wait where that stream follows every stream that
  can have work on the array (``SideStreams``; managed memory: copies under
  ``prefetch_min`` only).
- CuPy -> a Python scalar: ``bool()``, ``int()``, ``float()``,
  ``complex()`` and ``item()`` of a one-element array in managed memory
  copy the element, behind all the work queued before it: queued on the
  legacy default stream before the wait where that stream follows every
  stream that can have work on the array (``SideStreams``), else after the
  wait.
  Nothing can alias a Python scalar, and a host read in place would fault
  the element's page over to the host, and the next kernel writing near it
  would fault the page back: a solver's residual check each step
  (``if norm(r) < tol``) paid both.
- CuPy -> GPU libraries: ``__cuda_array_interface__``, ``__dlpack__`` with a
  stream, ``toDlpack`` wait likewise, then export as CuPy does, except that
  managed memory is reported as ``kDLCUDA`` (PyTorch and JAX refuse
  ``kDLCUDAManaged``; the memory is device-accessible either way).

While a stream captures a CUDA graph nothing captured has run and a wait
would invalidate the capture: host exports raise, as CuPy's host transfers
do then, and exports to GPU libraries wait for nothing.
"""

from __future__ import annotations

import ctypes
import time

import numpy

from . import _core
from ._cupy_alloc import CupyAllocator
from ._cupy_compat import (KDL_CPU, KDL_CUDA, KDL_CUDA_MANAGED, OwnWaits, SideStreams, capturing,
                           out_of_memory_error, set_capsule_device, sync_declarer, waiting_itself)
from ._cupy_patch import CupyPatches
from ._errors import UmpError
from ._placement import Placement
from ._release import Lease, ReleaseQueue

__all__ = ["CupyHook", "GPU_KINDS", "advice_code"]

#: Kinds whose blocks a kernel can use at their host address.
GPU_KINDS = frozenset({"system", "managed", "pinned"})

#: Pinned buffers of hooks uninstalled in a forked child, which must not free them.
_KEPT_IN_CHILD: list = []

#: Bytes of a pinned buffer a scalar conversion copies its element into
#: (complex128 and small structured elements; wider ones use pageable memory).
_ELEMENT_BYTES = 64


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
    """(kind, base, size, lo, hi, owner) if the array lies inside one live
    block of one of ``kinds``, else None."""
    kind, base, size, owner = _core.lookup_owner(ptr)
    if kind not in kinds:
        return None
    lo, hi = _extent(ptr, shape, strides, itemsize)
    if lo < base or hi > base + size:
        return None
    return kind, base, size, lo, hi, owner


def _converted(buffer, dtype, shape, to):
    """``to`` of the element of ``dtype`` at the start of ``buffer``, seen as
    an array of ``shape``, the CuPy array's: NumPy's conversions then raise
    where they would for ``get()``'s array (``int()`` of a 1-d array, in
    recent NumPy). A view, as ``to`` returns Python objects; but ``item()`` of a
    structured element keeps its subarray fields as arrays, views of the
    buffer, so a structured element is copied first."""
    element = numpy.frombuffer(buffer, dtype, 1).reshape(shape)
    return to(element if dtype.names is None else element.copy())


def _layout_ok(a, order) -> bool:
    """Whether ``a`` already has the memory order ``order`` asks for."""
    if order is None or order in ("K", "k"):
        return True
    flags = a.flags
    return {"C": flags.c_contiguous, "F": flags.f_contiguous,
            "A": flags.c_contiguous or flags.f_contiguous}.get(str(order).upper(), False)


def _shareable_dtype(dtype) -> bool:
    return dtype.kind in "biufc" and dtype.isnative and dtype.char not in "gG"


class _Export:
    """What NumPy wraps: the interface of a CuPy array's memory, holding it."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface, owner):
        self.__array_interface__ = interface
        self.owner = owner


class CupyHook:
    """Everything ump changes in CuPy while enabled, and how to undo it: the
    conversions between NumPy and CuPy and every export (this class), CuPy's
    allocator (:class:`~ump._cupy_alloc.CupyAllocator`) and the entry points
    that call the conversions (:class:`~ump._cupy_patch.CupyPatches`)."""

    def __init__(self, cupy, backend, arena, options, headroom: int, pool=None, pool_for=None,
                 arena_for=None, numpy_arena: int = -1):
        self.cupy = cupy
        self.numpy_arena = numpy_arena  # NumPy's arena id: its blocks are not CuPy's results
        self.device = options.device
        self.backend = backend
        self.options = options
        self.release = ReleaseQueue.shared(cupy)
        self.side_streams = SideStreams.shared(cupy)  # whether a scalar's copy may be queued before the wait
        self.out_of_memory = out_of_memory_error(cupy)
        self._declare_synchronize = sync_declarer(cupy)  # read once: every export calls it
        self.allocator = CupyAllocator(cupy, backend, arena, self.device, self.release, self.out_of_memory,
                                       pool=pool, pool_for=pool_for, arena_for=arena_for)
        self.placement = Placement(cupy, options, headroom, watch=self.allocator.watch)
        self.allocator.follow(self.placement)
        self.pool = self.allocator.pool
        # backend "device": a VMM pool, and NumPy <-> CuPy are copies
        self.copies = self.allocator.vmm
        self.patches = CupyPatches(cupy, self)
        self._element_buffers = []  # pinned buffers scalar() copies an element into

    # --- waiting for the GPU -------------------------------------------------
    def synchronize(self, stream=None, device=None, exporting=None, before=None) -> float:
        """Wait for what a reader must not overtake: the device's work (or
        ``stream``'s with ``sync="stream"``); after a device-wide wait,
        release NumPy memory that CuPy views used on that device. Returns
        the seconds waited, which the placement policy weighs
        (``exporting``: the block being exported, which its export decides;
        ``before``: a call that queues work the wait then covers, weighed
        with the wait).

        Raises
        ------
        UmpError
            (a ``RuntimeError``, as CuPy raises for a host transfer then)
            ``stream`` is capturing a CUDA graph, or the current stream is
            and the wait is device-wide: it would invalidate the capture.
        """
        self._refuse_while_capturing(stream)
        if stream is not None and self.options.sync != "stream":
            self._refuse_while_capturing(None)  # a device-wide wait stops any capture on it
        return self._wait(stream, device, exporting, before)

    def _wait(self, stream, device, exporting=None, before=None) -> float:
        self._declare_synchronize()
        start = time.perf_counter()
        if before is not None:
            before()
        if stream is not None and self.options.sync == "stream":
            with OwnWaits():
                stream.synchronize()
        else:
            self.release.wait_for(device)  # its waits pass the program's-wait wrapper uncounted
        return self._weigh(start, device, exporting)

    def program_wait(self, wait, device: int | None = None):
        """``wait()``, a wait the program asked CuPy for (a stream's, an
        event's, the device's), timed and weighed by the placement policy
        as ump's own waits are (``device``: the one waited for; None, or -1
        as CuPy's null stream names it: the current one). A program that
        synchronises before it reads otherwise leaves ump's waits nothing to
        see."""
        if waiting_itself():
            return wait()
        start = time.perf_counter()
        result = wait()
        self._weigh(start, device)
        return result

    def _weigh(self, start: float, device: int | None, exporting=None) -> float:
        """A wait for ``device`` (None or -1: the current one) that began at
        ``start`` has just ended: hand its seconds to the placement policy,
        and return them."""
        ended = time.perf_counter()
        if device is None or device < 0:
            device = self.cupy.cuda.runtime.getDevice()
        self.placement.on_sync(device, ended - start, exporting, ended)
        return ended - start

    def _refuse_while_capturing(self, stream=None):
        if capturing(self.cupy, stream):
            raise UmpError("the stream is capturing a CUDA graph: nothing captured has run, so "
                           "the host cannot read CuPy's results and ump cannot wait for the GPU "
                           "(end the capture and launch the graph first)")

    def wait_before_gpu_export(self, g, consumer_stream=None) -> bool:
        """Before another GPU library takes ``g``: wait for its device
        (True), unless the current stream or the consumer's (a handle, as
        DLPack passes it) captures a graph (False). Then nothing has run,
        and stream order alone must do: CuPy's own export orders the
        consumer's stream after its current one, or names it."""
        kind, base, _, owner = _core.lookup_ids(g.data.ptr)
        if kind in _core.KINDS:  # memory not ump's: its reads wait first anyway (get)
            # The consumer may write it on a stream of its own. An arena
            # maps its memory at one address; a VMM pool's may be mapped twice.
            self.side_streams.exported(base if owner < _core.MAX_ARENAS else None)
        device = g.data.device_id
        if capturing(self.cupy) or (isinstance(consumer_stream, int) and consumer_stream > 0
                                    and capturing(self.cupy, consumer_stream)):
            return False
        self._wait(None, device)
        return True

    # --- NumPy -> CuPy ------------------------------------------------------
    def wrap_host(self, a):
        """A CuPy array at ``a``'s address, or None if ``a`` cannot be shared."""
        if a.size == 0 or not a.flags.writeable:
            return None
        dtype = a.dtype
        if not _shareable_dtype(dtype):
            return None
        ptr = a.__array_interface__["data"][0]
        if ptr % dtype.itemsize or any(s % dtype.itemsize for s in a.strides):
            return None  # CuPy's kernels assume natural alignment
        found = _block_of(ptr, a.shape, a.strides, dtype.itemsize)
        if found is None:
            return None
        kind, base, size, lo, hi, _ = found
        cuda = self.cupy.cuda
        device = cuda.runtime.getDevice()
        lease = Lease(a, self.release, device)
        self.placement.on_handoff(kind, base, size, lease)
        mem = cuda.memory.UnownedMemory(lo, hi - lo, lease, device)
        memptr = cuda.memory.MemoryPointer(mem, ptr - lo)
        return self.cupy.ndarray(a.shape, dtype, memptr, a.strides)

    def array(self, obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
        """Stands in for ``cupy._core.array``."""
        original = self.patches.original["array"]
        if isinstance(obj, numpy.ndarray):
            if dtype is not None and numpy.dtype(dtype) != obj.dtype and copy is not False:
                # Stock CuPy casts with NumPy on the host; so does ump, into
                # a new block that CuPy can share (out-of-range float to int
                # casts differ between NumPy and the GPU).
                obj, copy = numpy.array(obj, dtype=dtype, order=order, copy=True), None
                dtype = None
            if self.copies:
                # A host array always needs a copy here, whatever `copy` says.
                if ndmin <= obj.ndim and dtype is None:
                    out = self.copy_in(obj, order)
                    if out is not None:
                        return out
            else:
                shared = self.wrap_host(obj)
                if shared is not None:
                    if (copy is not True and ndmin <= shared.ndim and dtype is None
                            and _layout_ok(shared, order)):
                        return shared  # the common case: nothing for CuPy to apply
                    # order, ndmin and copy=True are CuPy's to apply to a CuPy
                    # array: a view where it can, else a copy on the GPU.
                    out = original(shared, dtype, copy, order, subok, ndmin, blocking)
                    if out.data.mem is not shared.data.mem and not capturing(self.cupy):
                        # The copy reads `obj` in place, queued on the current
                        # stream. Stock CuPy returns once it has read pageable
                        # memory, and programs write `obj` right after.
                        with OwnWaits():
                            self.cupy.cuda.get_current_stream().synchronize()
                    return out
        return original(obj, dtype, copy, order, subok, ndmin, blocking)

    def copy_in(self, a, order):
        """Backend "device": a contiguous NumPy array in ump's pinned memory
        is copied by one DMA straight from its memory (CuPy would first copy
        it into a staging buffer). None where CuPy's own path must run."""
        dtype = a.dtype
        if (a.size == 0 or not a.flags.c_contiguous or not _layout_ok(a, order)
                or not _shareable_dtype(dtype)):
            return None
        ptr = a.__array_interface__["data"][0]
        if _block_of(ptr, a.shape, a.strides, dtype.itemsize, kinds=("pinned",)) is None:
            return None
        cupy = self.cupy
        out = cupy.empty(a.shape, dtype)
        stream = cupy.cuda.get_current_stream()
        out.data.copy_from_host_async(ptr, a.nbytes, stream)
        with OwnWaits():
            stream.synchronize()  # the caller may write to `a` as soon as we return
        return out

    # --- CuPy -> host -------------------------------------------------------
    def export(self, g, sync=True, stream=None, share_results=True):
        """The array interface of ``g`` for the host, once the GPU is done
        with it (and ump brought it back if ump had migrated it); None if
        ``g`` is not in host-visible ump memory, or, unless
        ``share_results``, is a small result (:meth:`get`); nothing is
        waited for then."""
        if g.size == 0:
            return None
        ptr = g.data.ptr
        found = _block_of(ptr, g.shape, g.strides, g.dtype.itemsize)
        if found is None:
            return None
        kind, base, size, lo, hi, owner = found
        if (not share_results and kind == "managed" and owner != self.numpy_arena
                and hi - lo < self.placement.min_bytes):
            return None
        waited = None
        if sync:
            waited = self.synchronize(stream, g.data.device_id, exporting=(base, size))
        else:
            self._refuse_while_capturing(stream)  # the kernels have not even run
        with OwnWaits():  # a move back waits for the stream, an event is read
            self.placement.on_host_export(kind, base, size, waited, stream)
            if kind == "managed" and owner != self.numpy_arena:
                self.placement.on_result_export(base, size, lo, hi, g.data.device_id, waited)
        iface = {
            "version": 3,
            "shape": g.shape,
            "typestr": g.dtype.str,
            "data": (ptr, False),
            "strides": g.strides,
        }
        try:
            iface["descr"] = g.dtype.descr
        except ValueError:
            pass  # fields out of order or overlapping: no descr says it; host_view restores the dtype
        return iface

    def host_view(self, g, sync=True, stream=None, share_results=True):
        """A NumPy array over ``g``'s memory after the wait, or None
        (:meth:`export`)."""
        iface = self.export(g, sync, stream, share_results)
        if iface is None:
            return None
        view = numpy.asarray(_Export(iface, g))
        # A typestr names a size, not a C type: 'q' (longlong) comes back
        # as 'l' (long), equal dtypes but printed differently; a structured
        # dtype without its descr comes back as raw bytes ('V12').
        same = view.dtype.char == g.dtype.char and view.dtype == g.dtype
        return view if same else view.view(g.dtype)

    def scalar(self, g, to):
        """``to`` (``bool``, ``int``, ``float``, ``complex`` or
        ``numpy.ndarray.item``) of the one element of ``g``, copied to the
        host once the work queued before has finished; None where
        ``g`` is not one element of managed memory (CuPy's own conversion,
        through :meth:`get`, serves it).

        A solver reads one each step (``if norm(r) < tol``), so this path
        is kept to the calls it needs: one lookup, one copy into pinned
        memory, the wait, and ``to`` of a view of the copy (a copy out of
        managed memory costs ~3–5 µs more than out of device memory
        whatever the API; into pageable memory 2.3–2.8 µs more again:
        docs/performance.md). Inside a solver's step each Python call here
        costs two to three times what it costs in a loop of reads alone."""
        if g.size != 1:
            return None
        data, dtype = g.data, g.dtype
        ptr, itemsize = data.ptr, dtype.itemsize
        kind, base, size, _ = _core.lookup_ids(ptr)  # _block_of's test, for one element
        if kind != _core.KIND_MANAGED or ptr + itemsize > base + size:
            return None
        if itemsize > _ELEMENT_BYTES:  # a wide structured element: pageable memory, as stock CuPy's copy
            host = ctypes.create_string_buffer(itemsize)
            self._copy_element(ctypes.addressof(host), ptr, itemsize, data.device_id, base)
            return _converted(host, dtype, g.shape, to)
        free = self._element_buffers
        try:
            host = free.pop()
        except IndexError:
            host = self._element_buffer()
        try:
            self._copy_element(host.ptr, ptr, itemsize, data.device_id, base)
            return _converted(host, dtype, g.shape, to)  # before the buffer is reused
        finally:
            free.append(host)  # list.pop/append: each thread that reads at once has its own

    def _copy_element(self, host: int, ptr: int, itemsize: int, device: int, block: int) -> None:
        """Copy ``itemsize`` bytes at ``ptr`` (in ump's block at ``block``)
        on ``device`` into ``host`` once all the GPU work queued before has
        finished.

        With one GPU and no stream the legacy default stream does not follow
        that may have work on the block
        (:class:`~ump._cupy_compat.SideStreams`), the copy is queued on that
        stream first, behind every kernel queued before, and the device-wide
        wait then covers it: one round trip to the GPU, as stock CuPy's own
        copy on its stream. Otherwise the wait comes first, then the copy.
        Into pageable ``host`` (a wide element) the queued copy returns only
        once it is done, so the wait is weighed from before the copy."""
        runtime, streams = self.cupy.cuda.runtime, self.side_streams
        if self._legacy_stream_follows_writers(block):
            # synchronize() refuses before it queues the copy: on the legacy
            # stream while the current stream captures, the copy would break
            # the capture. A capture on a blocking stream the thread is not
            # using breaks here, as it does at the device-wide wait either way.
            self.synchronize(None, device, before=lambda: runtime.memcpyAsync(
                host, ptr, itemsize, runtime.memcpyDeviceToHost, streams.legacy))
            return
        self.synchronize(None, device)
        runtime.memcpy(host, ptr, itemsize, runtime.memcpyDeviceToHost)

    def _element_buffer(self):
        cuda = self.cupy.cuda
        return cuda.PinnedMemoryPointer(cuda.PinnedMemory(_ELEMENT_BYTES), 0)

    def get(self, g, stream=None, order="C", out=None, blocking=True, share_results=False):
        """Stands in for ``cupy.ndarray.get``: ``g``'s own memory where the
        host can read it in place, else a copy; after the wait where
        ``blocking``.

        A small result is copied, as stock CuPy copies it, unless
        ``share_results`` (``ump.asnumpy``): an array CuPy made in managed
        memory (not NumPy's) spanning less than ``prefetch_min``, which the
        placement does not follow. The GPU holds its pages, so a read in
        place would fault them over to the host, and the next kernel
        writing there (CuPy's pool hands the memory out again; a slab's
        blocks share pages) would fault them back: a solver that reads an
        800 KB result each step took 1.2 ms a step so, 0.34 ms with the
        copy and 0.44 ms under stock CuPy (docs/backends.md).

        A copy is made after a wait for the device, except one on CuPy's
        null stream that follows every stream ump knows may write the array
        (:meth:`_copy_follows_every_stream`): work ump cannot see
        (a raw non-blocking stream handle, a C extension given the pointer)
        is then not waited for, as stock CuPy's copy does not wait for it
        (docs/guide.md, "Coherence")."""
        if out is None and _layout_ok(g, order):
            view = self.host_view(g, sync=blocking, stream=stream, share_results=share_results)
            if view is not None:
                return view
        original = self.patches.original["get"]
        if blocking and self._copy_follows_every_stream(g, stream):
            start = time.perf_counter()
            with OwnWaits():
                copy = original(g, stream=stream, order=order, out=out, blocking=True)
            self._weigh(start, g.data.device_id)  # the copy's wait, as the wait before it would be
            return copy
        if blocking:
            # CuPy copies on `stream` (or the current one) only: a kernel
            # another stream queued on the array must finish first.
            self.synchronize(stream, g.data.device_id)
        with OwnWaits():  # CuPy's copy waits for the stream it queued on
            return original(g, stream=stream, order=order, out=out, blocking=blocking)

    def _copy_follows_every_stream(self, g, stream) -> bool:
        """Whether CuPy's own copy of ``g`` is queued behind every kernel
        that may write it, so that ump need not wait for the device first:
        the copy goes on CuPy's null stream (the legacy default stream,
        which follows every blocking stream), the process sees one GPU, and
        no stream that stream does not follow may have work on ``g``'s
        memory, which is ump's. Then a copy is one round trip to the GPU, as
        with stock CuPy, not two: where several processes share the GPU
        each round trip waits its turn (docs/performance.md, run 27).
        Memory not ump's (another library's, imported) is waited for first,
        and so is managed memory of ``prefetch_min`` or more, whose copy's
        own time the placement must not weigh as the kernels'. The current
        stream must be the null stream too, even when ``stream`` names it: a
        current stream that captures a graph is then refused by the wait."""
        if (self.cupy.cuda.get_current_stream().ptr != 0
                or (stream is not None and stream.ptr != 0)):
            return False
        kind, base, _, _ = _core.lookup_ids(g.data.ptr)
        if kind == _core.KIND_MANAGED and g.nbytes >= self.placement.min_bytes:
            return False
        return kind in _core.KINDS and self._legacy_stream_follows_writers(base)

    def _legacy_stream_follows_writers(self, block: int) -> bool:
        """Whether the legacy default stream follows every stream that may
        have work on ump's block at ``block``: the process sees one GPU (on
        several, another GPU's kernel may write it through peer access) and
        no stream that stream does not follow may have work on the block
        (:class:`~ump._cupy_compat.SideStreams`). A copy queued on it then
        reads what every kernel queued before it wrote."""
        return self.release.one_gpu() and not self.side_streams.unordered_work_possible(block)

    def host_array(self, g, dtype=None, copy=None):
        """``numpy.asarray(g)`` under ump: shared where the memory is
        host-visible, else a copy; after the wait either way."""
        out = self.host_view(g)
        shared = out is not None
        if not shared:
            if copy is False:
                raise ValueError("this CuPy array is in device memory: NumPy can only get a copy of it "
                                 "(copy=False was asked for)")
            out = self.get(g)  # a copy, after the wait
        if dtype is not None and numpy.dtype(dtype) != out.dtype:
            if copy is False:
                raise ValueError(f"a {out.dtype} CuPy array cannot become {numpy.dtype(dtype)} without a copy "
                                 "(copy=False was asked for)")
            return out.astype(dtype)
        return out.copy() if copy is True and shared else out

    # --- CuPy -> other libraries --------------------------------------------
    def dlpack(self, g, stream=None, max_version=None, dl_device=None, copy=None):
        """Stands in for ``cupy.ndarray.__dlpack__``.

        A consumer on a GPU names its stream (PyTorch, JAX, CuPy do) and gets
        ``kDLCUDA``, the type ``__dlpack_device__`` reports. One that names
        the CPU, or neither a stream nor a device (``numpy.from_dlpack``), is
        a host consumer: it gets host-visible memory as ``kDLCPU`` at the
        same address after the wait, a host copy if it asks for one, and
        device memory as CuPy exports it (NumPy refuses ``kDLCUDA``)."""
        kwargs = {} if max_version is None else {"max_version": max_version}
        original = self.patches.original["__dlpack__"]
        to_cpu = dl_device is not None and dl_device[0] == KDL_CPU
        if to_cpu or (dl_device is None and stream is None):
            view = self.host_view(g)
            if view is not None:
                if copy is True:  # NumPy flags the copy only in versioned capsules
                    return view.__dlpack__(copy=True, **kwargs) if kwargs else view.copy().__dlpack__()
                return view.__dlpack__(**kwargs)
            if to_cpu or copy is True:
                self.synchronize(device=g.data.device_id)
                with OwnWaits():  # CuPy's host copy waits for its stream
                    return original(g, dl_device=(KDL_CPU, 0), copy=copy, **kwargs)
        managed_asked = dl_device is not None and dl_device[0] == KDL_CUDA_MANAGED
        if managed_asked:
            dl_device = None
        self.wait_before_gpu_export(g, stream)
        capsule = original(g, stream=stream, dl_device=dl_device, copy=copy, **kwargs)
        return capsule if managed_asked else self.cuda_capsule(g, capsule)

    def cuda_capsule(self, g, capsule):
        """``capsule`` of ``g``, with managed memory reported as ``kDLCUDA``."""
        if self.patches.original["__dlpack_device__"](g)[0] == KDL_CUDA_MANAGED:
            set_capsule_device(capsule, KDL_CUDA)
        return capsule

    def dlpack_device(self, g):
        kind, device = self.patches.original["__dlpack_device__"](g)
        return (KDL_CUDA, device) if kind == KDL_CUDA_MANAGED else (kind, device)

    # --- install / uninstall -----------------------------------------------
    def install(self, *, cupy_new: bool):
        """Patch CuPy and set its allocator; on any failure put back what
        was changed. ``cupy_new``: CuPy was imported by this ``enable()``
        with no other thread running, so nothing ran on it unwatched."""
        try:
            self.patches.install()
            self.patches.note_streams()
            # after note_streams(): no stream made in between goes unseen
            self.side_streams.rescan(scan=not cupy_new)
            if self.placement.mode == "auto" and self.backend.provider == _core.PROVIDER_MANAGED:
                # NumPy's blocks are managed memory the policy places, by waits.
                self.patches.wrap_waits()
            self.allocator.install()
        except BaseException:
            self.patches.restore()
            self.allocator.restore()
            raise

    def uninstall(self, cuda: bool = True):
        """Put CuPy's allocator and methods back; with ``cuda`` False (a
        forked child, which must not call CUDA) without the waits and the
        clean-up, each of which calls CUDA: what they would release stays
        with the process until it exits."""
        self.allocator.restore()
        buffers, self._element_buffers = self._element_buffers, []
        if not cuda:
            # Freeing pinned memory is a CUDA call: a forked child keeps them.
            _KEPT_IN_CHILD.extend(buffers)
            self.patches.restore()
            return
        del buffers  # freed now, not whenever the hook is dropped
        self.placement.close()
        self.patches.restore()
        # Not self.synchronize(): disable() must not fail half-way under
        # cupyx.allow_synchronize(False).
        self.release.wait_for()
        # Blocks CuPy's pool caches go back to the arena; blocks of live
        # arrays stay valid and return when those arrays are freed.
        self.pool.free_all_blocks()


def advice_code(name: str) -> int:
    try:
        return _core.ADVICE[name]
    except KeyError:
        raise ValueError(f"unknown advice {name!r}; choose one of "
                         + ", ".join(repr(a) for a in _core.ADVICE)) from None
