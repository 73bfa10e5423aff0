"""ctypes binding to the C core (csrc/): hooks, arenas, registry, CUDA calls.

ctypes releases the GIL around every call, which is what the C side expects:
none of its functions touch Python objects.
"""

from __future__ import annotations

import ctypes
import dataclasses

from . import _ucore
from ._errors import OutOfMemoryError, UmpError

# The version of the functions' signatures declared below (UMP_ABI_VERSION in
# csrc/ump.h). Constants and struct layouts are read from the extension.
ABI_VERSION = 6
if _ucore.ABI_VERSION != ABI_VERSION:  # pragma: no cover - a stale build
    raise ImportError(
        f"ump's C extension has ABI {_ucore.ABI_VERSION}, the Python layer expects "
        f"{ABI_VERSION}: rebuild it (pip install -e . or setup.py build_ext --inplace)"
    )

# csrc/ump.h's constants, as the extension (csrc/module.c) exports them.
KIND_IDS = dict(_ucore.KINDS)
KINDS = {kind: name for name, kind in KIND_IDS.items()}
PROVIDER_HOST = _ucore.UMP_PROVIDER_HOST
PROVIDER_MANAGED = _ucore.UMP_PROVIDER_MANAGED
PROVIDER_PINNED = _ucore.UMP_PROVIDER_PINNED
PROVIDER_DEVICE = _ucore.UMP_PROVIDER_DEVICE
MAX_ARENAS = _ucore.UMP_MAX_ARENAS
MAX_POOLS = _ucore.UMP_MAX_POOLS
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
CUDA_ERROR_OUT_OF_MEMORY = _ucore.CUDA_ERROR_OUT_OF_MEMORY
#: Statuses that mean the memory ran out: an arena's cap, the OS or provider, or the device.
OUT_OF_MEMORY = frozenset({ERR_CAP, ERR_NOMEM, CUDA_ERROR_OUT_OF_MEMORY})

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


_U64_MAX = 2**64 - 1


def _u64_arg(value: int, what: str) -> int:
    """``value`` if a C uint64_t/size_t holds it; ctypes would silently keep
    only its low 64 bits (2**64 + 100 bytes would become 100)."""
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"{what} must be between 0 and 2**64 - 1, got {value}")
    return value


def _sig(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_vp, _sz, _u64, _uptr, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
malloc = _sig("ump_malloc", _vp, _sz)
calloc = _sig("ump_calloc", _vp, _sz, _sz)
realloc = _sig("ump_realloc", _vp, _vp, _sz)
free = _sig("ump_free", None, _vp, _sz)
set_numpy_arena = _sig("ump_set_numpy_arena", _int, _int)
get_numpy_arena = _sig("ump_get_numpy_arena", _int)
_arena_create = _sig("ump_arena_create", _int, _int, _int, _u64, _int, _int, _uptr)
_arena_set_cap = _sig("ump_arena_set_cap", _int, _int, _u64)
_arena_alloc = _sig("ump_arena_alloc", _vp, _int, _sz)
_arena_free = _sig("ump_arena_free", _int, _vp)
_arena_trim = _sig("ump_arena_trim", _int, _int)
_arena_stats = _sig("ump_arena_stats", _int, _int, ctypes.POINTER(_CStats))
_fallback_stats = _sig("ump_fallback_stats", _int, ctypes.POINTER(_CStats))
foreign_frees = _sig("ump_foreign_frees", _u64)
_cuda_load = _sig("ump_cuda_load", _int, ctypes.c_char_p)
_cuda_set_context = _sig("ump_cuda_set_context", _int, _uptr, _int)
_prefetch = _sig("ump_prefetch", _int, _uptr, _u64, _int, _uptr)
_advise = _sig("ump_advise", _int, _uptr, _u64, _int, _int)
_error_name = _sig("ump_cuda_error_name", _int, _int, ctypes.c_char_p, _sz)
last_status = _sig("ump_last_status", _int)
fault_inject = _sig("ump_fault_inject", None, ctypes.c_int64, ctypes.c_int64)
fault_delay = _sig("ump_fault_delay", None, ctypes.c_uint32)
is_forked_child = _sig("ump_is_forked_child", _int)


_CVmmStats = _u64_struct("_CVmmStats", "ump_vmm_stats_t", _ucore.VMM_STATS_FIELDS,
                         _ucore.VMM_STATS_SIZE)
_CViewTimes = _u64_struct("_CViewTimes", "ump_vmm_view_times_t", _ucore.VMM_VIEW_TIMES_FIELDS,
                          _ucore.VMM_VIEW_TIMES_SIZE)


vmm_create = _sig("ump_vmm_create", _int, _int, _int, _uptr, _u64, _u64)
vmm_destroy = _sig("ump_vmm_destroy", _int, _int)
vmm_alloc = _sig("ump_vmm_alloc", _uptr, _int, _u64, _uptr)
vmm_free = _sig("ump_vmm_free", _int, _int, _uptr)
vmm_trim = _sig("ump_vmm_trim", _int, _int, _int)
vmm_set_limit = _sig("ump_vmm_set_limit", _int, _int, _u64)
vmm_stats = _sig("ump_vmm_stats", _int, _int, ctypes.POINTER(_CVmmStats))
vmm_grant = _sig("ump_vmm_grant", _int, _int, _int)
vmm_devices = _sig("ump_vmm_devices", _int, _int, ctypes.POINTER(_int), _int)
vmm_migrate = _sig("ump_vmm_migrate", _int, _int, _uptr, _u64, _int)
vmm_device_of = _sig("ump_vmm_device_of", _int, _int, _uptr, _u64)
vmm_buffer_create = _sig("ump_vmm_buffer_create", _int, _int, _u64)
vmm_buffer_destroy = _sig("ump_vmm_buffer_destroy", _int, _int, _int)
vmm_buffer_resize = _sig("ump_vmm_buffer_resize", _int, _int, _int, _u64)
vmm_buffer_info = _sig("ump_vmm_buffer_info", _int, _int, _int, ctypes.POINTER(_uptr),
                       ctypes.POINTER(_u64))
vmm_shared_create = _sig("ump_vmm_shared_create", _int, _int, _u64)
vmm_export = _sig("ump_vmm_export", _int, _int, _int, ctypes.POINTER(_int))
vmm_import = _sig("ump_vmm_import", _int, _int, _int, _u64, _int)
vmm_alias_create = _sig("ump_vmm_alias_create", _int, _int, _uptr, _u64, ctypes.POINTER(_uptr))
vmm_ring_create = _sig("ump_vmm_ring_create", _int, _int, _u64)
vmm_striped_create = _sig("ump_vmm_striped_create", _int, _int, _u64, ctypes.POINTER(_int), _int)
vmm_view_info = _sig("ump_vmm_view_info", _int, _int, _int, ctypes.POINTER(_uptr), ctypes.POINTER(_u64),
                     ctypes.POINTER(_CViewTimes))
vmm_view_destroy = _sig("ump_vmm_view_destroy", _int, _int, _int)


def vmm_view(pool: int, view: int) -> tuple[int, int, dict]:
    """(address, bytes mapped, set-up times by field) of a pool's view."""
    ptr, size, times = _uptr(), _u64(), _CViewTimes()
    check(vmm_view_info(pool, view, ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(times)),
          "reading a view")
    return ptr.value, size.value, {name: getattr(times, name) for name, _ in times._fields_}


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
    name: ctypes.addressof(fn)
    for name, fn in (("malloc", malloc), ("calloc", calloc), ("realloc", realloc), ("free", free))
}


def error_name(status: int) -> str:
    buf = ctypes.create_string_buffer(64)
    _error_name(status, buf, len(buf))
    return buf.value.decode()


def check(status: int, what: str) -> None:
    """Raise the ump exception for a C status (0 is success)."""
    if status == OK:
        return
    name = error_name(status)
    if status in OUT_OF_MEMORY:
        raise OutOfMemoryError(what, name)
    raise UmpError(what, name)


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
        _u64_arg(cap, "an arena cap in bytes")
        self.kind = kind
        self.device = device
        flags = (ARENA_ADVISE_HOST if advise_host else 0) | (ARENA_CUPY if cupy_side else 0)
        arena_id = _arena_create(KIND_IDS[kind], provider, cap, flags, device, context)
        if arena_id < 0:
            check(last_status(), f"creating the {kind} arena")
        self.id = arena_id

    def allocate(self, size: int) -> int:
        """Allocate ``size`` bytes; raise :class:`OutOfMemoryError` past the cap."""
        _u64_arg(size, "an allocation size in bytes")
        ptr = _arena_alloc(self.id, size)
        if not ptr:
            status = last_status()
            if status == ERR_INJECTED:
                raise OutOfMemoryError(f"{self.kind} arena: allocation of {size} bytes failed", error_name(status))
            check(status or ERR_CAP, f"{self.kind} arena: cannot allocate {size} bytes")
        return ptr

    def deallocate(self, ptr: int) -> None:
        check(_arena_free(ptr), f"{self.kind} arena: {ptr:#x} is not a live block")

    def trim(self) -> None:
        """Give every wholly free chunk back to the provider."""
        check(_arena_trim(self.id), f"trimming the {self.kind} arena")

    def set_cap(self, cap: int) -> None:
        _u64_arg(cap, "an arena cap in bytes")
        check(_arena_set_cap(self.id, cap), "setting the arena cap")

    def statistics(self) -> Statistics:
        out = _CStats()
        check(_arena_stats(self.id, ctypes.byref(out)), "reading arena statistics")
        return Statistics._from_c(out)


def lookup(ptr: int) -> tuple[str | None, int, int]:
    """(kind, base, size) of the live ump block holding ``ptr``."""
    kind, base, size, _ = _ucore.lookup(ptr)
    return KINDS.get(kind), base, size


def lookup_owner(ptr: int) -> tuple[str | None, int, int, int]:
    """(kind, base, size, owner) of the live ump block holding ``ptr``; the
    owner is an arena id, or ``MAX_ARENAS + pool id`` for a VMM pool."""
    kind, base, size, owner = _ucore.lookup(ptr)
    return KINDS.get(kind), base, size, owner


def cuda_load() -> None:
    check(_cuda_load(None), "loading libcuda.so.1")


def cuda_set_context(ctx: int, device: int) -> None:
    _cuda_set_context(ctx, device)


#: cuMemAdvise's advice codes (cuda.h), by the names ump.advise takes.
ADVICE = {
    "read_mostly": 1, "unset_read_mostly": 2,
    "preferred_location": 3, "unset_preferred_location": 4,
    "accessed_by": 5, "unset_accessed_by": 6,
}


def prefetch(ptr: int, size: int, device: int, stream: int) -> None:
    _u64_arg(ptr, "an address")
    _u64_arg(size, "a size in bytes")
    check(_prefetch(ptr, size, device, stream), f"prefetching {size} bytes at {ptr:#x}")


def advise(ptr: int, size: int, advice: int, device: int) -> None:
    _u64_arg(ptr, "an address")
    _u64_arg(size, "a size in bytes")
    check(_advise(ptr, size, advice, device), f"advising {size} bytes at {ptr:#x}")
