"""enable() / disable(): choosing a backend and putting the hooks in place."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

from . import _core, _cupy_hook, _numpy_hook, _vmm, backends
from ._errors import UmpError
from ._probe import check_device_index, probe

__all__ = ["Options", "enable", "disable", "is_enabled", "enabled", "current", "State"]

_PLACEMENTS = ("auto", "host", "migrate")
_SYNCS = ("device", "stream")


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of :func:`enable` (pass them as keyword arguments).

    Parameters
    ----------
    cap : int or float, optional
        Most bytes the backend may hold: an int is bytes, a float in (0, 1]
        a fraction of the device's free memory at ``enable()`` (of the host's
        available memory for ``host``). Default: 0.5, and never more than half
        of the host's available memory. Past the cap NumPy gets plain memory
        and CuPy raises :class:`ump.OutOfMemoryError`.
    device : int
        The CUDA device whose primary context and memory ump uses (0).
    placement : {"auto", "host", "migrate"}
        Where managed NumPy arrays live when handed to CuPy: ``"host"`` keeps
        them in host memory, mapped by the GPU; ``"migrate"`` prefetches them
        to the GPU at every hand-off; ``"auto"`` starts like ``"host"`` and
        migrates a block once the GPU time spent on it over the link exceeded
        what migrating it would have cost (docs/backends.md).
    prefetch_min : int
        Blocks smaller than this (bytes, default 2 MiB) are never migrated.
    sync : {"device", "stream"}
        What a host export waits for: every kernel of the device (default;
        CuPy does not record which stream wrote an array), or only the stream
        passed to ``get(stream=...)``.
    """

    cap: int | float | None = None
    device: int = 0
    placement: str = "auto"
    prefetch_min: int = 2 << 20
    sync: str = "device"

    def __post_init__(self):
        cap = self.cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)):
                raise TypeError(f"cap must be an int (bytes) or a float fraction, not {type(cap).__name__}")
            if isinstance(cap, float) and not 0.0 < cap <= 1.0:
                raise ValueError(f"cap as a fraction must be in (0, 1], got {cap}")
            if isinstance(cap, int) and not 0 < cap < 1 << 63:
                raise ValueError(f"cap must be a positive number of bytes below 2**63, got {cap}")
        check_device_index(self.device)
        if self.placement not in _PLACEMENTS:
            raise ValueError(f"placement must be one of {_PLACEMENTS}, got {self.placement!r}")
        if self.sync not in _SYNCS:
            raise ValueError(f"sync must be one of {_SYNCS}, got {self.sync!r}")
        pm = self.prefetch_min
        if isinstance(pm, bool) or not isinstance(pm, int) or pm < 0:
            raise ValueError(f"prefetch_min must be a non-negative int (bytes), got {pm!r}")


@dataclasses.dataclass
class State:
    backend: backends.Backend
    options: Options
    requested: str
    numpy_arena: _core.Arena
    cupy_arena: _core.Arena | None
    cupy: _cupy_hook.CupyHook | None


_lock = threading.RLock()
_state: State | None = None
_retired: list = []  # hooks of earlier enables: their pools own live CuPy blocks
_device_pools: dict = {}  # device -> the VMMPool backend="device" uses, kept across enables


def current() -> State | None:
    return _state


def _gpu_context(device: int) -> tuple[int, int]:
    """Retain the device's primary context (CuPy's too); (context, free bytes)."""
    from cuda.bindings import driver

    from ._probe import _call

    dev = _call(driver.cuDeviceGet, device)
    ctx = _call(driver.cuDevicePrimaryCtxRetain, dev)
    _call(driver.cuCtxPushCurrent, ctx)
    try:
        free, _total = _call(driver.cuMemGetInfo)
    finally:
        _call(driver.cuCtxPopCurrent)
    return int(ctx), int(free)


def _resolve_cap(backend, options: Options, free_device: int | None) -> int:
    cap = options.cap
    if isinstance(cap, int):
        return cap
    default = backend.default_cap(free_device)
    if cap is None:
        return default
    basis = free_device if free_device is not None else backends._host_available_bytes()
    return max(int(basis * cap), _core.ALIGN)


def enable(backend: str = "auto", **options) -> str:
    """Put NumPy and CuPy on unified memory for the rest of the process.

    Parameters
    ----------
    backend : {"auto", "system", "managed", "pinned", "device", "host"}
        ``"auto"`` picks the first of system, managed, pinned that the device
        supports, and ``host`` on a machine without a GPU. ``"device"`` is
        not unified: CuPy allocates from a VMM device pool
        (:class:`ump.VMMPool`), NumPy from pinned memory, and transfers are
        copies at DMA speed.
    **options
        See :class:`Options`.

    Returns
    -------
    str
        The backend enabled.

    Raises
    ------
    BackendUnavailableError
        The backend cannot run on this machine; the message says why.
    UmpError
        ``CUPY_ENABLE_UMP=1`` is missing for a GPU backend, CuPy was imported
        with its own UMP path on a GPU where it fails, or ump is already
        enabled with another backend or options.
    ValueError, TypeError
        Bad options.

    Notes
    -----
    Calling it again with the same arguments does nothing. To change backend
    call :func:`disable` first. Arrays made before stay valid and are freed by
    their own allocator.
    """
    global _state
    opts = Options(**options)
    if backend != "auto":
        backends.get(backend)  # unknown names fail before anything happens
    with _lock:
        if _state is not None:
            if (_state.requested, _state.options) == (backend, opts):
                return _state.backend.name
            raise UmpError(
                f"ump is already enabled with backend {_state.backend.name!r}; "
                "call ump.disable() before enabling it again with other settings"
            )
        caps = probe()
        chosen = backends.select(backend, caps, opts.device)
        free_device = None
        cupy = None
        if chosen.uses_gpu:
            if os.environ.get("CUPY_ENABLE_UMP") != "1":
                raise UmpError(
                    "CUPY_ENABLE_UMP=1 is not set: set it in the environment before Python "
                    "starts (export CUPY_ENABLE_UMP=1), then call ump.enable()"
                )
            cupy = _cupy_hook.import_cupy(sam=chosen.name == "system")
            _core.cuda_load()
            ctx, free_device = _gpu_context(opts.device)
            _core.cuda_set_context(ctx, opts.device)
        cap = _resolve_cap(chosen, opts, free_device)
        numpy_arena = _core.Arena(chosen.numpy_arena_kind, chosen.provider, cap, chosen.advise_host)
        cupy_arena = hook = pool = None
        if cupy is not None:
            if chosen.name == "device":
                pool = _device_pools.get(opts.device)
                if pool is None:
                    pool = _device_pools[opts.device] = _vmm.VMMPool(opts.device, limit=cap)
                else:
                    pool.set_limit(cap)
            else:
                # Its own arena even where the chunks are alike: statistics
                # then tell NumPy's blocks from those CuPy's pool caches.
                cupy_arena = _core.Arena(chosen.name, chosen.provider, cap, cupy_side=True)
            hook = _cupy_hook.CupyHook(cupy, chosen, cupy_arena, opts, pool=pool)
            with cupy.cuda.Device(opts.device):
                hook.install()
        _numpy_hook.install(numpy_arena.id)
        _state = State(chosen, opts, backend, numpy_arena, cupy_arena, hook)
        return chosen.name


def disable() -> bool:
    """Restore NumPy's and CuPy's allocators and conversions as they were.

    Returns True if ump was enabled, False if there was nothing to undo.
    Arrays allocated while enabled stay valid; their memory goes back to
    ump's arenas when they are freed.
    """
    global _state
    with _lock:
        if _state is None:
            return False
        if _state.cupy is not None:
            _state.cupy.uninstall()
            # Keep a pool alive while arrays still use its blocks.
            _retired[:] = [h for h in _retired if h.pool.used_bytes()]
            _retired.append(_state.cupy)
        _numpy_hook.uninstall()
        for arena in (_state.numpy_arena, _state.cupy_arena):
            if arena is not None:
                arena.trim()  # wholly free chunks go back to the driver/OS
        _state = None
        return True


def is_enabled() -> bool:
    """Whether :func:`enable` is in force."""
    return _state is not None


@contextlib.contextmanager
def enabled(backend: str = "auto", **options):
    """``with ump.enabled(...):`` enables ump for the block, then disables it.

    Yields the backend's name.
    """
    name = enable(backend, **options)
    try:
        yield name
    finally:
        disable()
