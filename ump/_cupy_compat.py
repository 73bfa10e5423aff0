"""Everything ump does to CuPy's internals, in one place.

ump changes CuPy through its Python-visible surface (``cupy._core.array``,
attributes of ``cupy.ndarray``) and, when CuPy was imported with
``CUPY_ENABLE_UMP=1`` on a GPU without HMM/ATS, through two flags CuPy keeps
in C. Each of these is checked against the CuPy versions ump knows; on any
other CuPy ump refuses with a clear error instead of patching blind.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import mmap
import os
import struct
import sys
import threading

import numpy

from ._errors import OutOfMemoryError, UmpError

__all__ = ["import_cupy", "cupy_module", "check_cupy", "Patches", "out_of_memory_error", "set_capsule_device",
           "sync_declarer", "OwnWaits", "waiting_itself", "capturing", "OnePerCupy", "SideStreams", "KDL_CPU",
           "KDL_CUDA", "KDL_CUDA_MANAGED"]

#: CuPy releases whose internals ump was checked against (major versions).
SUPPORTED_MAJORS = (13, 14)

#: Parameters ump relies on, as CuPy names them (cupy/_core/core.pyx).
_SIGNATURES = {
    "cupy._core.array": ("obj", "dtype", "copy", "order", "subok", "ndmin", "blocking"),
    "cupy.ndarray.get": ("self", "stream", "order", "out", "blocking"),
}

#: Where CuPy keeps ``CUPY_ENABLE_UMP`` as read at its import: a C ``bint``
#: per Cython module (core.pyx and memory.pyx), not reachable from Python.
_UMP_FLAGS = (
    ("cupy._core.core", b"__pyx_v_4cupy_5_core_4core__is_ump_enabled"),
    ("cupy.cuda.memory", b"__pyx_v_4cupy_4cuda_6memory__is_ump_enabled"),
)

# DLPack device types (dlpack.h).
KDL_CPU, KDL_CUDA, KDL_CUDA_MANAGED = 1, 2, 13


def check_cupy(cupy) -> None:
    """Refuse a CuPy whose internals ump does not know.

    Raises
    ------
    UmpError
        The CuPy version is not one ump supports, or a function ump replaces
        takes other arguments than ump passes.
    """
    version = getattr(cupy, "__version__", "unknown")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = -1
    if major not in SUPPORTED_MAJORS:
        raise UmpError(f"CuPy {version} is not supported: ump hooks into CuPy's internals and knows "
                       f"CuPy {', '.join(f'{m}.x' for m in SUPPORTED_MAJORS)}")
    for where, expected in _SIGNATURES.items():
        obj = cupy
        for part in where.split(".")[1:]:
            obj = getattr(obj, part, None)
        if obj is None:
            raise UmpError(f"CuPy {version} has no {where}, which ump replaces")
        try:
            params = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            continue  # compiled without signatures: the version check stands
        if params != expected:
            raise UmpError(f"CuPy {version}: {where}{params} differs from the {expected} ump replaces")


def builtin_ump_active(cupy) -> bool:
    """Whether CuPy runs with its own UMP path on: only then does it give
    plain host memory a device id (cupy/cuda/memory.pyx, UnownedMemory)."""
    buf = ctypes.create_string_buffer(512)
    mem = cupy.cuda.memory.UnownedMemory(ctypes.addressof(buf), len(buf), buf)
    return mem.device_id >= 0


def import_cupy():
    """Import CuPy for ump, with CuPy's built-in UMP path off.

    On a GPU without HMM/ATS that path asserts in ``cupy.array``; on SAM
    machines it has the defects docs/architecture.md lists. If CuPy is
    not imported yet it is imported with ``CUPY_ENABLE_UMP`` hidden; if it
    was imported with the variable set, its two flags are turned off, so
    CuPy behaves as if it had been imported without it.

    Raises
    ------
    UmpError
        Unsupported CuPy, or its flags cannot be found in its modules.
    """
    cupy = sys.modules.get("cupy")
    if cupy is None:
        saved = os.environ.pop("CUPY_ENABLE_UMP", None)
        try:
            import cupy
        finally:
            if saved is not None:
                os.environ["CUPY_ENABLE_UMP"] = saved
        check_cupy(cupy)
        return cupy
    check_cupy(cupy)
    if builtin_ump_active(cupy):
        # Off on SAM machines too: ump's own paths replace CuPy's there as
        # well, as when ump imports CuPy itself.
        for module, symbol in _UMP_FLAGS:
            _clear_flag(sys.modules[module], symbol)
        if builtin_ump_active(cupy):  # pragma: no cover - a CuPy the checks missed
            raise UmpError("CuPy's built-in UMP path is still on after ump turned it off")
    return cupy


def cupy_module():
    """CuPy as the program imported it, or imported for ump (:func:`import_cupy`)
    if no one did yet: what ump's CuPy arrays over its own memory are made
    with."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None else import_cupy()


def _clear_flag(module, symbol: bytes) -> None:
    """Set a C ``bint`` of a compiled module from 1 to 0, found by its name
    in the module's ELF symbol table."""
    path = module.__file__
    found = _elf_symbol(path, symbol)
    if found is None:
        raise UmpError(
            f"CuPy was imported with CUPY_ENABLE_UMP=1 before ump.enable(), and ump cannot turn "
            f"CuPy's UMP flag off in {path} (no symbol table). Call ump.enable() before importing "
            "CuPy, or start the program with `python -m ump run`.")
    offset, size = found
    base = _load_base(module)
    flag = (ctypes.c_int if size == 4 else ctypes.c_byte).from_address(base + offset)
    if size not in (1, 4) or flag.value not in (0, 1):
        raise UmpError(f"{path}: {symbol.decode()} is not the flag ump expects (size {size}, "
                       f"value {flag.value})")
    flag.value = 0


# Elf64_Sym: st_name, st_info, st_other, st_shndx, st_value, st_size
_ELF64_SYM = numpy.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                          ("value", "<u8"), ("size", "<u8")])


def _elf_symbol(path: str, suffix: bytes) -> tuple[int, int] | None:
    """(value, size) of the first symbol whose name ends with ``suffix``
    (names are C++-mangled, ``_ZL<n>`` + the Cython name), or None.

    CuPy's core module holds tens of thousands of symbols, too many to
    unpack one by one in Python at every start: the names are matched in
    the string table, the symbols as one array."""
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            return None
    with data:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian
            return None
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
            if kind != 2 or entsize != _ELF64_SYM.itemsize:  # SHT_SYMTAB
                continue
            spans = _name_spans_ending(data, sections[link][4], sections[link][5], suffix)
            if not spans:
                continue
            # A copy, not a view: the mapping closes whatever happens here.
            symbols = numpy.frombuffer(data[offset:offset + size - size % entsize], _ELF64_SYM)
            firsts, lasts = numpy.array(spans, numpy.int64).T
            names = symbols["name"].astype(numpy.int64)
            span = numpy.searchsorted(firsts, names, "right") - 1
            hit = (span >= 0) & (names <= lasts[span.clip(0)])
            if hit.any():
                index = int(hit.argmax())
                return int(symbols["value"][index]), int(symbols["size"][index])
    return None


def _name_spans_ending(data, start: int, size: int, suffix: bytes) -> list[tuple[int, int]]:
    """The name offsets, as (first, last) per string, whose names end with
    ``suffix`` in the string table at ``start``: linkers share tails, so a
    symbol's name may begin anywhere in a longer string up to the suffix."""
    spans, end = [], start + size
    at = data.find(suffix + b"\0", start, end)
    while at >= 0:
        first = max(data.rfind(b"\0", start, at) + 1, start)
        spans.append((first - start, at - start))
        at = data.find(suffix + b"\0", at + 1, end)
    return spans


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _load_base(module) -> int:
    """Where the dynamic loader placed a compiled module (dladdr)."""
    lib = ctypes.CDLL(module.__file__)  # already loaded: the same handle
    init = getattr(lib, "PyInit_" + module.__name__.rsplit(".", 1)[-1])
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not libc.dladdr(ctypes.cast(init, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fbase:
        raise UmpError(f"cannot locate {module.__file__} in memory")
    return info.dli_fbase


class Patches:
    """Attributes ump sets on CuPy's objects, and how to put them back."""

    def __init__(self):
        self._saved = []

    def set(self, owner, name: str, value) -> None:
        # For a class, only its own __dict__ counts: an inherited attribute
        # is restored by deleting ump's.
        before = owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name)
        self._saved.append((owner, name, before))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._saved:
            owner, name, before = self._saved.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


_ABSENT = object()


def _nothing_to_declare() -> None:
    pass


def sync_declarer(cupy):
    """The call that tells CuPy's synchronisation detection
    (``cupyx.allow_synchronize``) the host is about to wait for the device:
    it raises ``cupyx.DeviceSynchronized`` where the caller disallowed that,
    as CuPy's own waits do. A no-op for a CuPy without that detection."""
    syncdetect = getattr(getattr(cupy, "_core", None), "syncdetect", None)
    return _nothing_to_declare if syncdetect is None else syncdetect._declare_synchronize


_own = threading.local()


class OwnWaits:
    """``with OwnWaits():`` this thread's waits for the GPU are ump's own
    (its conversions', its moves', its releases') until the block ends. The
    program's waits, which ump times for the placement policy
    (``CupyHook.program_wait``), pass through these uncounted: ump counts
    its own once, or not at all. Nested blocks keep the outer one's."""

    __slots__ = ("_before",)

    def __enter__(self):
        self._before = getattr(_own, "waiting", False)
        _own.waiting = True

    def __exit__(self, *exc):
        _own.waiting = self._before


def waiting_itself() -> bool:
    """Whether this thread is inside :class:`OwnWaits`."""
    return getattr(_own, "waiting", False)


def capturing(cupy, stream=None) -> bool:
    """Whether ``stream`` (a CuPy stream or a stream's handle; the current
    stream if None) is capturing a CUDA graph. Nothing captured runs before
    the graph is launched, and a wait for the device or the stream
    invalidates the capture: CuPy asks this before each host transfer and
    refuses it; ump asks before its waits and placement moves."""
    cuda = cupy.cuda
    if stream is None:
        stream = cuda.get_current_stream()
    return cuda.runtime.streamIsCapturing(stream if isinstance(stream, int) else stream.ptr)


class OnePerCupy:
    """A class of which the process needs one object per CuPy module:
    ``cls.shared(cupy)``, made at its first use."""

    _shared: dict

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._shared = {}  # id(cupy) -> the object, each subclass its own

    @classmethod
    def shared(cls, cupy):
        found = cls._shared.get(id(cupy))
        if found is None:
            found = cls._shared[id(cupy)] = cls(cupy)
        return found


class SideStreams(OnePerCupy):
    """Whether this process may have work queued on a stream that CUDA's
    legacy default stream does not follow.

    The legacy default stream waits for the work queued before on every
    blocking stream of its device, whichever thread queued it, so a copy
    queued on it reads what every kernel queued there before it wrote: a
    scalar read is one round trip to the GPU (the copy queued, then the wait
    for the device) instead of two. A non-blocking stream is not followed:
    CuPy's ``Stream(non_blocking=True)``, another library's stream that CuPy
    wraps (``Stream.from_external``, ``ExternalStream``) unless it reads as
    blocking, and the streams of any GPU library an array was exported to
    (``__cuda_array_interface__``, ``__dlpack__``, ``toDlpack``), which ump
    cannot see. Once a CuPy stream is seen the answer stays yes for the
    process: work on a stream outlives the stream. Exports: below.

    CuPy's streams made while ump is enabled are noted as they are made
    (``CupyPatches.note_streams``). At the first question after each
    ``enable()`` (:meth:`rescan`) the answer is yes, so that read waits for
    the device first and finishes whatever was queued while ump was not
    watching (on a stream since dropped, too); the streams alive then are
    looked at for the questions after it.

    An export of an arena's block (managed, pinned or system memory, which
    ump maps at one address only) is noted by that block: only its memory
    can the other library's streams write unseen, so only reads of it wait
    first. A program that hands one array to PyTorch or Numba then keeps
    its other reads at one round trip each, which counts where several
    processes share the GPU and every round trip waits its turn (PyLops's
    tests in four processes: docs/performance.md, run 27). A block stays
    noted for good: the other library may still have work queued on it
    after its arrays are gone, and CuPy's pool hands the memory out again
    (an arena's block keeps its base, and goes back to the arena only after
    a wait for the device). An export of VMM pool memory, which an alias or
    an import maps at a second address and whose blocks the pool reuses at
    other bases, makes the answer yes for the process, as does an export
    past ``MAX_EXPORTED`` blocks."""

    #: Blocks whose exports are kept apart; past them every read waits first.
    MAX_EXPORTED = 4096

    def __init__(self, cupy):
        runtime = cupy.cuda.runtime
        #: cudaStreamLegacy: the legacy default stream by name (handle 0
        #: names it only in code built without per-thread default streams).
        self.legacy = runtime.streamLegacy
        #: The handles that name a default stream: 0 and the legacy one (the
        #: legacy stream itself) and the per-thread one (a blocking stream).
        self.defaults = frozenset({0, runtime.streamLegacy, runtime.streamPerThread})
        #: The stream base class: Stream, ExternalStream and
        #: Stream.from_external all initialise through its ``__init__``.
        self.base = stream_base(cupy)
        self.seen = None  # None: not asked since the last enable()
        self.exported_blocks: set[int] = set()  # bases of ump's blocks handed to other GPU libraries
        # A stream noted while another thread scans must not be overwritten
        # by the scan's answer: the answer is set under the lock, or only
        # ever raised to True. Reentrant: a collection during the scan can
        # run a finaliser that makes a stream.
        self._lock = threading.RLock()

    def unordered_work_possible(self, block: int | None = None) -> bool:
        """Whether work may be queued on a stream the legacy default stream
        does not follow: CuPy's anywhere, or another library's on ump's
        block at ``block`` (None: any block handed over)."""
        seen = self.seen
        if seen is None:
            with self._lock:
                if self.seen is None:
                    self.seen = self._scan()
                    return True  # the first question since enable(): wait for what was not watched
                seen = self.seen
        if seen:
            return True
        exported = self.exported_blocks
        return bool(exported) if block is None else block in exported

    def note(self, stream) -> None:
        """A CuPy stream object was just made."""
        if self.seen is not True and self._unordered(stream):
            self._mark_unordered()

    def exported(self, block: int | None = None) -> None:
        """An array of ump's memory was handed to another GPU library, which
        may write it on its own streams: of an arena's block at ``block``,
        else (None) of memory whose reads must all wait first from now on."""
        exported = self.exported_blocks
        if self.seen is True or block in exported:
            return
        if block is None or len(exported) >= self.MAX_EXPORTED:
            self._mark_unordered()
        else:
            exported.add(block)  # set.add holds the GIL: no lock

    def rescan(self, scan: bool = True) -> None:
        """``enable()``: the next question waits, then looks at the streams
        alive. ``scan=False``: that ``enable()`` imported CuPy itself, so no
        work was queued through it unwatched and no stream of it is alive
        but the default ones; there is nothing to wait for or look at (the
        scan walks every object the collector tracks: milliseconds that
        each program ``python -m ump run`` starts would pay)."""
        with self._lock:
            if not self.seen:
                self.seen = None if scan else False

    def _mark_unordered(self) -> None:
        with self._lock:
            self.seen = True

    def _unordered(self, stream) -> bool:
        ptr = getattr(stream, "ptr", None)
        if ptr is None or ptr in self.defaults:
            return False  # no handle yet (made by __new__, its __init__ not run or failed): no work
        try:
            return bool(stream.is_non_blocking)
        except Exception:  # its flags cannot be read (another device's, destroyed): assume the worst
            return True

    def _scan(self) -> bool:
        classes, stack = [], [self.base]
        while stack:
            cls = stack.pop()
            classes.append(cls)
            stack.extend(cls.__subclasses__())
        # An object of a class defined in Python refers to its class.
        return any(self._unordered(o) for o in gc.get_referrers(*classes) if isinstance(o, self.base))


def stream_base(cupy):
    """The class whose ``__init__`` every CuPy stream object runs (CuPy's
    ``_BaseStream``): the most basic class of ``cupy.cuda.Stream`` that
    defines one."""
    return next(k for k in reversed(cupy.cuda.Stream.__mro__) if "__init__" in vars(k) and k is not object)


_oom_classes: dict = {}


def out_of_memory_error(cupy):
    """ump's OutOfMemoryError that CuPy users' ``except
    cupy.cuda.memory.OutOfMemoryError`` also catches."""
    cls = _oom_classes.get(id(cupy))
    if cls is None:
        base = cupy.cuda.memory.OutOfMemoryError

        class CupyOutOfMemoryError(OutOfMemoryError, base):
            __module__ = "ump"
            __qualname__ = "OutOfMemoryError"

            def __init__(self, message, cuda_error=None, size=0, total=0, limit=0):
                OutOfMemoryError.__init__(self, message, cuda_error)
                self._size, self._total, self._limit = size, total, limit

            def __reduce__(self):
                return OutOfMemoryError, self.args

        cls = _oom_classes[id(cupy)] = CupyOutOfMemoryError
    return cls


# A DLPack capsule holds a DLManagedTensorVersioned ("dltensor_versioned":
# version, manager_ctx, deleter, flags, then the DLTensor) or a legacy
# DLManagedTensor ("dltensor": the DLTensor first). In a DLTensor the device
# type follows the data pointer.
_DEVICE_TYPE_OFFSET = {b"dltensor_versioned": 32 + 8, b"dltensor": 8}
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.argtypes, _capsule_valid.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes, _capsule_pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p


def set_capsule_device(capsule, device_type: int) -> None:
    """Rewrite the device type of an unconsumed DLPack capsule."""
    for name, offset in _DEVICE_TYPE_OFFSET.items():
        if _capsule_valid(capsule, name):
            ctypes.c_int32.from_address(_capsule_pointer(capsule, name) + offset).value = device_type
            return
    raise UmpError("not an unconsumed DLPack capsule")
