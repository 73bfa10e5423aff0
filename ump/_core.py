"""ctypes binding to the C core (csrc/): hooks, arenas, registry, CUDA calls.

ctypes releases the GIL around every call, which is what the C side expects:
none of its functions touch Python objects.
"""

from __future__ import annotations

import ctypes
import dataclasses
import operator
import os

from . import _ucore
from ._errors import InvalidArgumentError, OutOfMemoryError, UmpError

# The version of the functions' signatures declared below (UMP_ABI_VERSION in
# csrc/ump.h). Constants and struct layouts are read from the extension.
ABI_VERSION = 8
if _ucore.ABI_VERSION != ABI_VERSION:  # pragma: no cover - a stale build
    raise ImportError(
        f"ump's C extension has ABI {_ucore.ABI_VERSION}, the Python layer expects "
        f"{ABI_VERSION}: rebuild it (pip install -e . or setup.py build_ext --inplace)"
    )

# csrc/ump.h's constants, as the extension (csrc/module.c) exports them.
KIND_IDS = dict(_ucore.KINDS)
KINDS = {kind: name for name, kind in KIND_IDS.items()}
KIND_MANAGED = KIND_IDS["managed"]
PROVIDER_HOST = _ucore.UMP_PROVIDER_HOST
PROVIDER_MANAGED = _ucore.UMP_PROVIDER_MANAGED
PROVIDER_PINNED = _ucore.UMP_PROVIDER_PINNED
PROVIDER_DEVICE = _ucore.UMP_PROVIDER_DEVICE
MAX_ARENAS = _ucore.UMP_MAX_ARENAS
MAX_POOLS = _ucore.UMP_MAX_POOLS
#: The smallest chunk an arena takes, so the smallest cap that fits one.
CHUNK_MIN = _ucore.UMP_CHUNK_MIN
#: The most bytes one VMM buffer, view or import may span.
VMM_MAX_BYTES = _ucore.UMP_VMM_MAX_BYTES
#: The most address space a VMM pool reserves.
VMM_MAX_RESERVE = _ucore.UMP_VMM_MAX_RESERVE
#: The most devices a VMM pool may grant access to.
VMM_MAX_DEVICES = _ucore.UMP_VMM_MAX_DEVICES
#: What a view is, by the value C gives it (MappedMemory.kind).
VIEW_KINDS = {value: name for name, value in _ucore.VIEW_KINDS.items()}
#: cuMemAdvise's advice codes, by the names ump.advise takes.
ADVICE = dict(_ucore.ADVICE)
ARENA_ADVISE_HOST = _ucore.UMP_ARENA_ADVISE_HOST
ARENA_CUPY = _ucore.UMP_ARENA_CUPY
ALIGN = _ucore.UMP_ALIGN

# Statuses: 0, ump's own (< 0) and CUDA's CUresult values (> 0).
OK = _ucore.UMP_OK
ERR_NOMEM = _ucore.UMP_ERR_NOMEM
ERR_CAP = _ucore.UMP_ERR_CAP
ERR_NOCUDA = _ucore.UMP_ERR_NOCUDA
ERR_FORKED = _ucore.UMP_ERR_FORKED
ERR_ARG = _ucore.UMP_ERR_ARG
ERR_INJECTED = _ucore.UMP_ERR_INJECTED
ERR_HANDLE = _ucore.UMP_ERR_HANDLE
ERR_UNSUPPORTED = _ucore.UMP_ERR_UNSUPPORTED
ERR_OS = _ucore.UMP_ERR_OS
ERR_RANGE = _ucore.UMP_ERR_RANGE
CUDA_ERROR_INVALID_VALUE = _ucore.CUDA_ERROR_INVALID_VALUE
CUDA_ERROR_OUT_OF_MEMORY = _ucore.CUDA_ERROR_OUT_OF_MEMORY

lib = ctypes.CDLL(_ucore.__file__)


def _u64_struct(name: str, c_name: str, fields: tuple[str, ...], size: int) -> type:
    """A ctypes mirror of ``c_name``, a C struct of uint64_t fields, checked
    against the struct's size as the extension was compiled."""
    struct = type(name, (ctypes.Structure,), {"_fields_": [(f, ctypes.c_uint64) for f in fields]})
    if ctypes.sizeof(struct) != size:
        raise ImportError(f"{c_name} has {size} bytes in ump's C extension but its ctypes mirror "
                          f"{name} has {ctypes.sizeof(struct)}: a field of the struct in csrc/ump.h "
                          "is not uint64_t, or the extension is stale (rebuild it)")
    return struct


_CStats = _u64_struct("_CStats", "ump_stats_t", _ucore.STATS_FIELDS, _ucore.STATS_SIZE)
_CVmmStats = _u64_struct("_CVmmStats", "ump_vmm_stats_t", _ucore.VMM_STATS_FIELDS,
                         _ucore.VMM_STATS_SIZE)
_CViewTimes = _u64_struct("_CViewTimes", "ump_vmm_view_times_t", _ucore.VMM_VIEW_TIMES_FIELDS,
                          _ucore.VMM_VIEW_TIMES_SIZE)
_CDevice = _u64_struct("_CDevice", "ump_device_t", _ucore.DEVICE_FIELDS, _ucore.DEVICE_SIZE)


# --- every argument that crosses into C ------------------------------------------
# ctypes turns a Python int into a C integer by keeping its low bits: 2**64 + 512
# bytes reach C as 512, device 2**32 as device 0, and an address 2**64 past a
# block names the block. So each C function is declared with what its parameters
# are (C type and meaning), and every call through this module checks its
# arguments against that before C sees them: this is the one place.

@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a C function: its ctypes type and, for an integer,
    the range its meaning allows (``lo`` None: a pointer C writes through,
    or an array, passed as it is; ``nullable``: None stands for NULL)."""

    name: str
    ctype: type
    lo: int | None = None
    hi: int | None = None
    nullable: bool = False


def _c_range(ctype) -> tuple[int, int]:
    bits = 8 * ctypes.sizeof(ctype)
    return (-(1 << bits - 1), (1 << bits - 1) - 1) if ctype(-1).value == -1 else (0, (1 << bits) - 1)


def _integer(name: str, ctype, lo: int | None = None, nullable: bool = False) -> Param:
    cmin, cmax = _c_range(ctype)
    return Param(name, ctype, cmin if lo is None else max(lo, cmin), cmax, nullable)


_vp, _sz, _u64, _uptr, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int


def size(name: str = "size") -> Param:
    """Bytes (uint64_t, size_t)."""
    return _integer(name, _u64)


def address(name: str = "ptr", nullable: bool = False) -> Param:
    """An address (uintptr_t; a void * where None is NULL)."""
    return _integer(name, _vp if nullable else _uptr, nullable=nullable)


def device(name: str = "device", host: bool = False) -> Param:
    """A CUDA device ordinal (int); with ``host``, -1 names the host."""
    return _integer(name, _int, lo=-1 if host else 0)


def handle(name: str) -> Param:
    """An opaque driver handle: a stream or a context (pointer-sized)."""
    return _integer(name, _uptr)


def number(name: str, lo: int | None = None) -> Param:
    """An int: an id, a count, flags, a file descriptor (``lo=0``)."""
    return _integer(name, _int, lo=lo)


def out(name: str, ctype) -> Param:
    """A pointer C writes through (``ctypes.byref``, or an array)."""
    return Param(name, ctypes.POINTER(ctype))


def _bound(v: int) -> str:
    for bits in (31, 32, 63, 64):
        if v == (1 << bits) - 1:
            return f"2**{bits} - 1"
        if v == -(1 << bits):
            return f"-2**{bits}"
    return str(v)


def _checked_args(name: str, params: tuple, args: tuple) -> tuple:
    """The arguments as C may take them, or the error naming the first that
    does not fit its parameter (InvalidArgumentError is a ValueError)."""
    if len(args) != len(params):
        raise TypeError(f"{name}() takes {len(params)} arguments, got {len(args)}")
    fixed = []
    for p, value in zip(params, args):
        if p.lo is not None and not (value is None and p.nullable):
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise TypeError(f"{name}: {p.name} must be an integer, not {type(value).__name__}")
            value = operator.index(value)
            if not p.lo <= value <= p.hi:
                raise InvalidArgumentError(f"{name}: {p.name} must be an integer from "
                                           f"{_bound(p.lo)} to {_bound(p.hi)}, got {value}")
        fixed.append(value)
    return tuple(fixed)


def declare(name: str, restype, *params: Param):
    """The C function ``name`` of the core, called with checked arguments.
    ``.raw`` is the ctypes function itself (the NEP 49 hooks need its
    address)."""
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = [p.ctype for p in params]
    bounds = tuple((p.lo, p.hi) for p in params)
    n = len(params)

    def call(*args):
        # The common case costs a few comparisons: exact ints inside their
        # ranges. Anything else (None for NULL, NumPy integers, bad values,
        # a wrong count) is sorted out, or refused, by _checked_args.
        if len(args) == n:
            for value, (lo, hi) in zip(args, bounds):
                if lo is not None and not (type(value) is int and lo <= value <= hi):
                    break
            else:
                return fn(*args)
        return fn(*_checked_args(name, params, args))

    call.__name__ = call.__qualname__ = name
    call.raw = fn
    call.params = params
    return call


malloc = declare("ump_malloc", _vp, size())
calloc = declare("ump_calloc", _vp, size("nmemb"), size())
realloc = declare("ump_realloc", _vp, address(nullable=True), size())
free = declare("ump_free", None, address(nullable=True), size())
set_numpy_arena = declare("ump_set_numpy_arena", _int, number("arena"))
get_numpy_arena = declare("ump_get_numpy_arena", _int)
_arena_create = declare("ump_arena_create", _int, number("kind"), number("provider"), size("cap"),
                        number("flags"), device(host=True), handle("context"), out("arena", _int))
_arena_set_cap = declare("ump_arena_set_cap", _int, number("arena"), size("cap"))
_arena_alloc = declare("ump_arena_alloc", _vp, number("arena"), size())
_arena_free = declare("ump_arena_free", _int, address(nullable=True))
_arena_trim = declare("ump_arena_trim", _int, number("arena"))
_arena_stats = declare("ump_arena_stats", _int, number("arena"), out("stats", _CStats))
_fallback_stats = declare("ump_fallback_stats", _int, out("stats", _CStats))
foreign_frees = declare("ump_foreign_frees", _u64)
_cuda_load = declare("ump_cuda_load", _int, Param("path", ctypes.c_char_p))
_cuda_set_context = declare("ump_cuda_set_context", _int, handle("context"), device())
cuda_init = declare("ump_cuda_init", _int, out("driver_version", _int), out("count", _int))
device_probe = declare("ump_device_probe", _int, device(), out("fields", _CDevice), Param("name", ctypes.c_char_p),
                       size("len"))
device_retain = declare("ump_device_retain", _int, device(), out("context", _uptr))
device_release = declare("ump_device_release", _int, device())
device_memory = declare("ump_device_memory", _int, handle("context"), out("free", _u64), out("total", _u64))
device_can_access_peer = declare("ump_device_can_access_peer", _int, device(), device("peer"), out("can", _int))
device_active = declare("ump_device_active", _int, device(), out("active", _int))
context_push = declare("ump_context_push", _int, handle("context"))
context_pop = declare("ump_context_pop", _int)
_prefetch = declare("ump_prefetch", _int, address(), size(), device(host=True), handle("stream"))
_advise = declare("ump_advise", _int, address(), size(), number("advice"), device(host=True))
_error_name = declare("ump_cuda_error_name", _int, number("status"), Param("buf", ctypes.c_char_p),
                      size("len"))
last_status = declare("ump_last_status", _int)
last_os_error = declare("ump_last_os_error", _int)
fault_inject = declare("ump_fault_inject", None, _integer("after", ctypes.c_int64),
                       _integer("count", ctypes.c_int64))
fault_status = declare("ump_fault_status", None, number("status"))
fault_delay = declare("ump_fault_delay", None, _integer("usec", ctypes.c_uint32))
fault_signal = declare("ump_fault_signal", None, number("fd", lo=-1))
is_forked_child = declare("ump_is_forked_child", _int)

_pool, _view, _buf = number("pool"), number("view"), number("buffer")
vmm_create = declare("ump_vmm_create", _int, number("provider"), device(), handle("context"),
                     size("reserve"), size("limit"), out("pool", _int))
vmm_destroy = declare("ump_vmm_destroy", _int, _pool)
vmm_alloc = declare("ump_vmm_alloc", _uptr, _pool, size(), handle("stream"))
vmm_free = declare("ump_vmm_free", _int, _pool, address())
vmm_trim = declare("ump_vmm_trim", _int, _pool, number("keep_handles"))
vmm_set_limit = declare("ump_vmm_set_limit", _int, _pool, size("limit"))
vmm_stats = declare("ump_vmm_stats", _int, _pool, out("stats", _CVmmStats))
vmm_grant = declare("ump_vmm_grant", _int, _pool, device())
vmm_devices = declare("ump_vmm_devices", _int, _pool, out("devices", _int), number("max", lo=0),
                      out("n", _int))
vmm_migrate = declare("ump_vmm_migrate", _int, _pool, address(), size(), device())
vmm_device_of = declare("ump_vmm_device_of", _int, _pool, address(), size(), out("device", _int))
vmm_buffer_create = declare("ump_vmm_buffer_create", _int, _pool, size("max_bytes"), out("buffer", _int))
vmm_buffer_destroy = declare("ump_vmm_buffer_destroy", _int, _pool, _buf)
vmm_buffer_resize = declare("ump_vmm_buffer_resize", _int, _pool, _buf, size("nbytes"))
vmm_buffer_info = declare("ump_vmm_buffer_info", _int, _pool, _buf, out("ptr", _uptr), out("size", _u64))
vmm_shared_create = declare("ump_vmm_shared_create", _int, _pool, size(), out("view", _int))
vmm_export = declare("ump_vmm_export", _int, _pool, _view, out("fd", _int))
vmm_import = declare("ump_vmm_import", _int, _pool, number("fd", lo=0), size("nbytes"), device(),
                     out("view", _int))
vmm_alias_create = declare("ump_vmm_alias_create", _int, _pool, address(), size(), out("alias", _uptr),
                           out("view", _int))
vmm_ring_create = declare("ump_vmm_ring_create", _int, _pool, size(), out("view", _int))
vmm_striped_create = declare("ump_vmm_striped_create", _int, _pool, size(), out("devices", _int),
                             number("ndevices", lo=0), out("view", _int))
vmm_view_info = declare("ump_vmm_view_info", _int, _pool, _view, out("ptr", _uptr), out("size", _u64),
                        out("kind", _int), out("times", _CViewTimes))
vmm_view_destroy = declare("ump_vmm_view_destroy", _int, _pool, _view)


def made(fn, what: str, *args, reasons: dict | None = None, ctype=_int) -> int:
    """Call a C function that makes something and writes its id through its
    last parameter: the id, or the exception for its status."""
    value = ctype()
    check(fn(*args, ctypes.byref(value)), what, reasons)
    return value.value


def vmm_view(pool: int, view: int) -> tuple[int, int, str, dict]:
    """(address, bytes mapped, kind, set-up times by field) of a pool's view."""
    ptr, size, kind, times = _uptr(), _u64(), _int(), _CViewTimes()
    check(vmm_view_info(pool, view, ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(kind),
                        ctypes.byref(times)), "reading a view")
    return (ptr.value, size.value, VIEW_KINDS[kind.value],
            {name: getattr(times, name) for name, _ in times._fields_})


def vmm_buffer(pool: int, buf: int) -> tuple[int, int]:
    """(address, bytes in use) of a pool's growable buffer."""
    ptr, size = _uptr(), _u64()
    check(vmm_buffer_info(pool, buf, ctypes.byref(ptr), ctypes.byref(size)), "reading a buffer")
    return ptr.value, size.value

# numpy_allocator takes the address of a *function pointer* and calls through
# it: ctypes.addressof of a foreign function is the address of the slot that
# holds its entry point. The function objects live in this module, so the
# slots stay valid for the life of the process.
HOOK_ADDRESSES = {
    name: ctypes.addressof(fn.raw)
    for name, fn in (("malloc", malloc), ("calloc", calloc), ("realloc", realloc), ("free", free))
}


def error_name(status: int) -> str:
    buf = ctypes.create_string_buffer(64)
    _error_name(status, buf, len(buf))
    return buf.value.decode()


#: What each status of the C core raises, and why, where the status alone
#: says it; a caller may say why in its own words (``reasons``). A CUresult
#: not listed raises UmpError with CUDA's name for it.
STATUS_ERRORS: dict[int, tuple[type, str | None]] = {
    ERR_NOMEM: (OutOfMemoryError, None),
    ERR_CAP: (OutOfMemoryError, None),
    CUDA_ERROR_OUT_OF_MEMORY: (OutOfMemoryError, None),
    ERR_RANGE: (OutOfMemoryError, "the reserved address range has no room (blocks never move)"),
    ERR_INJECTED: (OutOfMemoryError, None),  # stands in for a provider's failure
    ERR_ARG: (InvalidArgumentError, None),
    ERR_HANDLE: (UmpError, "not a live handle, or not the memory it claims to be"),
    ERR_FORKED: (UmpError, "made before fork(): a child cannot use it (its memory is the parent's)"),
    ERR_NOCUDA: (UmpError, "libcuda.so.1 is not loaded"),
    ERR_UNSUPPORTED: (UmpError, "the CUDA driver cannot share physical memory"),
    ERR_OS: (OSError, None),  # with the errno C kept (EMFILE, ...)
}

#: Statuses that mean the memory ran out.
OUT_OF_MEMORY = frozenset(s for s, (cls, _) in STATUS_ERRORS.items() if cls is OutOfMemoryError)


def error_for(status: int, what: str, reason: str | None = None) -> Exception:
    """The exception for a C status (not 0): ``what`` was being done, and
    ``reason`` (else the table's) says why it failed."""
    cls, default = STATUS_ERRORS.get(status, (UmpError, None))
    reason = reason or default
    message = f"{what}: {reason}" if reason else what
    if cls is OSError:
        err = last_os_error()
        return OSError(err, f"{message}: {os.strerror(err)}")
    return cls(message, error_name(status))


def check(status: int, what: str, reasons: dict | None = None) -> None:
    """Raise the exception for a C status (0 is success); ``reasons`` maps
    statuses to what they mean to this caller."""
    if status != OK:
        raise error_for(status, what, reasons.get(status) if reasons else None)


@dataclasses.dataclass(frozen=True)
class Statistics:
    """Allocation statistics of one arena (bytes are block capacities).

    ``current``/``peak``/``total`` follow RMM's statistics adaptor; ``held``
    is what the arena took from its provider, ``cached`` the part of it that
    is wholly free, ``cap`` its limit.
    """

    current_bytes: int
    peak_bytes: int
    total_bytes: int
    current_count: int
    peak_count: int
    total_count: int
    held_bytes: int = 0
    cached_bytes: int = 0
    cap_bytes: int = 0
    chunk_allocs: int = 0
    chunk_frees: int = 0
    failures: int = 0

    @classmethod
    def _from_c(cls, c: _CStats) -> "Statistics":
        return cls(**{name: getattr(c, name) for name, _ in _CStats._fields_})


def fallback_statistics() -> Statistics:
    """Statistics of the plain aligned blocks served outside any arena."""
    out = _CStats()
    check(_fallback_stats(ctypes.byref(out)), "reading fallback statistics")
    return Statistics._from_c(out)


class Arena:
    """A size-class arena of the C core over chunks from one provider.

    Arenas live as long as the process (blocks may outlive ``disable()``);
    creating one with the same kind, provider, advice, device and context
    returns the same arena with the new cap.

    Arenas of one kind share a budget (``cap`` is its cap): the backend's
    main one (``device=-1``), or that of one GPU (``device=k``) for memory
    that lives there. ``context`` is the CUDA context chunks are made under
    (0: ump's), the device ``cudaPointerGetAttributes`` names for them.
    """

    def __init__(self, kind: str, provider: int, cap: int, advise_host: bool = False,
                 cupy_side: bool = False, device: int = -1, context: int = 0):
        self.kind = kind
        self.device = device
        flags = (ARENA_ADVISE_HOST if advise_host else 0) | (ARENA_CUPY if cupy_side else 0)
        self.id = made(_arena_create, f"creating the {kind} arena", KIND_IDS[kind], provider, cap,
                       flags, device, context)

    def allocate(self, size: int) -> int:
        """Allocate ``size`` bytes; raise :class:`OutOfMemoryError` past the cap."""
        ptr = _arena_alloc(self.id, size)
        if not ptr:
            raise error_for(last_status() or ERR_CAP, f"{self.kind} arena: cannot allocate {size} bytes")
        return ptr

    def deallocate(self, ptr: int) -> None:
        check(_arena_free(ptr), f"{self.kind} arena: {ptr:#x} is not a live block")

    def trim(self) -> None:
        """Give every wholly free chunk back to the provider."""
        check(_arena_trim(self.id), f"trimming the {self.kind} arena")

    def set_cap(self, cap: int) -> None:
        check(_arena_set_cap(self.id, cap), "setting the arena cap")

    def statistics(self) -> Statistics:
        out = _CStats()
        check(_arena_stats(self.id, ctypes.byref(out)), "reading arena statistics")
        return Statistics._from_c(out)


#: (kind id, base, size, owner) of the live ump block holding an address:
#: :func:`lookup_owner` without the kind's name (a scalar read's test).
lookup_ids = _ucore.lookup


def lookup(ptr: int) -> tuple[str | None, int, int]:
    """(kind, base, size) of the live ump block holding ``ptr``."""
    kind, base, size, _ = lookup_ids(ptr)
    return KINDS.get(kind), base, size


def lookup_owner(ptr: int) -> tuple[str | None, int, int, int]:
    """(kind, base, size, owner) of the live ump block holding ``ptr``; the
    owner is an arena id, or ``MAX_ARENAS + pool id`` for a VMM pool."""
    kind, base, size, owner = lookup_ids(ptr)
    return KINDS.get(kind), base, size, owner


def cuda_load() -> None:
    check(_cuda_load(None), "loading libcuda.so.1")


def cuda_set_context(ctx: int, device: int) -> None:
    check(_cuda_set_context(ctx, device), f"making device {device}'s context ump's")


def prefetch(ptr: int, size: int, device: int, stream: int) -> None:
    check(_prefetch(ptr, size, device, stream), f"prefetching {size} bytes at {ptr:#x}")


def advise(ptr: int, size: int, advice: int, device: int) -> None:
    check(_advise(ptr, size, advice, device), f"advising {size} bytes at {ptr:#x}")
