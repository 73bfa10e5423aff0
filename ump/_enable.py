"""enable() / disable(): choosing a backend and putting the hooks in place."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
import warnings

from . import _core, _cupy_compat, _cupy_hook, _devices, _driver, _numpy_hook, _probe, backends
from ._errors import UmpError, UmpWarning
from ._options import Options, check_device_index
from ._probe import probe
from ._version import pip_install

__all__ = ["enable", "disable", "is_enabled", "enabled", "current", "State"]


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


def current() -> State | None:
    return _state


def _cupy_arena_on(chosen: backends.Backend, opts: Options, main: _core.Arena, device: int) -> _core.Arena:
    """The arena CuPy allocates from on a GPU other than the enabled one,
    made at its first use. Its chunks are made under that GPU's context, so
    they name that GPU to cudaPointerGetAttributes as CuPy's arrays do; it
    has that GPU's own budget where the backend's memory lives on the GPU
    (managed), and shares the main one where it is the host's (pinned).
    Chunks of plain host memory (system) have no context: the main arena."""
    if chosen.provider == _core.PROVIDER_HOST:
        return main
    check_device_index(device)

    def make(ctx: int, free: int, total: int) -> _core.Arena:
        if chosen.gpu_resident:
            try:
                cap = _budgets(chosen, opts, (free, total))[1]
            except UmpError:
                cap = 0  # no room on that GPU: CuPy's allocations there are out of memory
            budget = device
        else:
            cap, budget = main.statistics().cap_bytes, -1
        return _core.Arena(chosen.name, chosen.provider, cap, cupy_side=True, device=budget, context=ctx)

    return _devices.cupy_arena(device, make)


def _as_options(options) -> Options:
    """``enable()``'s keyword arguments, or one :class:`Options` (instance or
    dict) passed as ``options=``."""
    given = options.pop("options", None)
    if given is not None:
        if options:
            raise TypeError(f"enable() takes options= or keyword options, not both: {sorted(options)}")
        if isinstance(given, Options):
            return given
        if not isinstance(given, dict):
            raise TypeError(f"enable(options=...) takes an ump.Options or a dict, not {type(given).__name__}")
        options = dict(given)
    known = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"enable() got unknown option(s) {', '.join(map(repr, unknown))}; "
                        f"the options are {', '.join(sorted(known))}")
    return Options(**options)


def _differences(state: State, backend: str, opts: Options) -> str:
    diffs = [f"backend {state.requested!r} -> {backend!r}"] if state.requested != backend else []
    for field in dataclasses.fields(Options):
        old, new = getattr(state.options, field.name), getattr(opts, field.name)
        if old != new:
            diffs.append(f"{field.name} {old!r} -> {new!r}")
    return ", ".join(diffs)


def _budgets(chosen: backends.Backend, opts: Options, device: tuple[int, int] | None):
    """(NumPy side's cap, CuPy side's cap, headroom) in bytes."""
    free, total = device if device is not None else (None, None)
    headroom = opts.headroom if opts.headroom is not None else (
        backends.default_headroom(total) if total is not None else 0)
    cap = opts.cap
    if cap is None:
        caps = chosen.default_cap(free, headroom), chosen.cupy_cap(free, headroom)
        if min(caps) < _core.CHUNK_MIN:
            where = (f"the device has {free} bytes free and the headroom is {headroom}" if free is not None
                     else f"the host has {_probe.host_available_bytes()} bytes available")
            raise UmpError(f"no room for the {chosen.name} backend's budget: {where}; free memory, "
                           "or set cap= (and headroom=) explicitly")
        return (*caps, headroom)
    if isinstance(cap, float):
        basis = free if free is not None else _probe.host_available_bytes()
        cap = max(int(basis * cap), _core.CHUNK_MIN)
    if free is not None and chosen.uses_gpu and not chosen.vmm_pool and cap > free - headroom:
        warnings.warn(f"cap={cap} bytes is more than the device's free memory less the headroom "
                      f"({free - headroom} bytes): {chosen.name} memory beyond what the GPU holds can "
                      "hang a shared GPU", UmpWarning, stacklevel=3)  # the caller of enable()
    return cap, cap, headroom


#: Set by ``python -m ump run`` for the program and the processes it starts:
#: ump is wanted there, so enable() needs no ``CUPY_ENABLE_UMP=1``, which
#: the launcher does not set (in a child that does not enable ump it would
#: turn CuPy's own UMP path on, which asserts on GPUs without HMM/ATS).
LAUNCHED = "UMP_LAUNCHED"


def _import_cupy(chosen: backends.Backend):
    """CuPy for a GPU backend; any failure to import it is an UmpError."""
    try:
        return _cupy_compat.import_cupy()
    except UmpError:
        raise
    except Exception as err:
        if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == "cupy":
            raise UmpError(f"the {chosen.name} backend needs CuPy, which is not installed: "
                           f"{pip_install('cuda12', 'cuda13')}, matching the CUDA major version "
                           "of the driver") from err
        raise UmpError(f"the {chosen.name} backend needs CuPy, which failed to import: "
                       f"{type(err).__name__}: {err}") from err


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
        See :class:`Options`; or ``options=`` an :class:`Options` instance
        or a dict of them.

    Returns
    -------
    str
        The backend enabled.

    Raises
    ------
    BackendUnavailableError
        The backend cannot run on this machine; the message says why.
    UmpError
        ``CUPY_ENABLE_UMP=1`` is missing for a GPU backend, CuPy is missing,
        fails to import or is a version ump does not support, CUDA failed to
        set up the device (a full GPU, say: ``cuda_error`` names CUDA's
        error), or ump is already enabled with another backend or options
        (the message names what differs).
    ValueError, TypeError
        Bad options; the message names the option.

    Notes
    -----
    Calling it again with the same arguments does nothing. To change backend
    call :func:`disable` first. Arrays made before stay valid and are freed by
    their own allocator. CuPy may be imported before or after: if it was
    imported with ``CUPY_ENABLE_UMP=1`` on a GPU without HMM/ATS, ump turns
    CuPy's own UMP path off (it fails there).
    """
    global _state
    opts = _as_options(options)
    if backend != "auto":
        backends.get(backend)  # unknown names fail before anything happens
    with _lock:
        if _state is not None:
            if (_state.requested, _state.options) == (backend, opts):
                return _state.backend.name
            raise UmpError(
                f"ump is already enabled with backend {_state.backend.name!r}; this call differs "
                f"({_differences(_state, backend, opts)}): call ump.disable() first"
            )
        chosen = backends.select(backend, probe(), opts.device)
        # CuPy imported by this call, with no other thread that could use it
        # before the hook is in: nothing can run on it unwatched.
        cupy_new = "cupy" not in sys.modules and threading.active_count() == 1
        cupy, device = _gpu_side(chosen, opts) if chosen.uses_gpu else (None, None)
        numpy_cap, cupy_cap, headroom = _budgets(chosen, opts, device)
        numpy_arena = _core.Arena(chosen.numpy_arena_kind, chosen.provider, numpy_cap, chosen.advise_host)
        cupy_arena = hook = None
        if cupy is not None:
            cupy_arena, hook = _install_cupy(cupy, chosen, opts, (cupy_cap, headroom), numpy_arena, cupy_new)
        try:
            _numpy_hook.install(numpy_arena.id)
        except BaseException:
            if hook is not None:
                hook.uninstall()  # nothing half-enabled stays behind
            raise
        _state = State(chosen, opts, backend, numpy_arena, cupy_arena, hook)
        return chosen.name


def _gpu_side(chosen: backends.Backend, opts: Options):
    """(CuPy, (free, total) bytes of the device) for a GPU backend, with the
    device's primary context made ump's."""
    if os.environ.get("CUPY_ENABLE_UMP") != "1" and os.environ.get(LAUNCHED) != "1":
        raise UmpError(
            "CUPY_ENABLE_UMP=1 is not set: set it in the environment before Python "
            "starts (export CUPY_ENABLE_UMP=1), then call ump.enable(); or start the "
            "program with `python -m ump run`"
        )
    cupy = _import_cupy(chosen)
    _driver.load()
    ctx, free, total = _devices.context(opts.device)
    _core.cuda_set_context(ctx, opts.device)
    return cupy, (free, total)


def _install_cupy(cupy, chosen: backends.Backend, opts: Options, budget: tuple[int, int],
                  numpy_arena: _core.Arena, cupy_new: bool):
    """(CuPy's arena or None, the installed hook): CuPy's memory from its
    own arena, or from the device's VMM pool (backend "device").
    ``cupy_new``: CuPy was imported by this ``enable()``, no other thread running."""
    cupy_cap, headroom = budget
    cupy_arena = pool = None
    if chosen.vmm_pool:
        pool = _devices.existing_vmm_pool(opts.device)
        if pool is None:
            pool = _devices.vmm_pool(opts.device, limit=cupy_cap)
        else:
            # free memory no longer counts what the pool already holds
            pool.set_limit(cupy_cap if opts.cap is not None else cupy_cap + pool.total_bytes())
    else:
        # Its own arena even where the chunks are alike: statistics then
        # tell NumPy's blocks from those CuPy's pool caches.
        cupy_arena = _core.Arena(chosen.name, chosen.provider, cupy_cap, cupy_side=True)
    _devices.forget_cupy_arenas()  # made again under this enable's options (the same C arenas)
    arena_for = None if cupy_arena is None else functools.partial(_cupy_arena_on, chosen, opts, cupy_arena)
    hook = _cupy_hook.CupyHook(cupy, chosen, cupy_arena, opts, headroom, pool=pool,
                               pool_for=_devices.vmm_pool, arena_for=arena_for,
                               numpy_arena=numpy_arena.id)
    with cupy.cuda.Device(opts.device):
        hook.install(cupy_new=cupy_new)
    return cupy_arena, hook


def disable() -> bool:
    """Restore NumPy's and CuPy's allocators and conversions as they were.

    Returns True if ump was enabled, False if there was nothing to undo.
    Arrays allocated while enabled stay valid; their memory goes back to
    ump's arenas when they are freed.

    Raises
    ------
    UmpError
        Called from a thread other than the one that called :func:`enable`
        while that thread still runs: NumPy's allocator is per thread, and
        only that thread can put its own back. Nothing is changed.

    Notes
    -----
    In a child process made by ``fork()`` it calls no CUDA function, as
    nothing in the child does: it puts the allocators and CuPy's methods
    back without waiting for the device or returning memory to the driver.
    """
    global _state
    with _lock:
        if _state is None:
            return False
        _numpy_hook.check_uninstall()  # another thread's disable() changes nothing
        forked = bool(_core.is_forked_child())
        if _state.cupy is not None:
            _state.cupy.uninstall(cuda=not forked)
            # Keep a pool alive while arrays still use its blocks.
            _retired[:] = [h for h in _retired if h.pool.used_bytes()]
            _retired.append(_state.cupy)
        _numpy_hook.uninstall()
        if not forked or _state.backend.provider == _core.PROVIDER_HOST:
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

    Yields the backend's name. Nested inside an enabled block (or after
    :func:`enable`) with the same settings it leaves ump enabled on exit:
    only the block that enabled ump disables it.
    """
    was_enabled = _state is not None
    name = enable(backend, **options)
    try:
        yield name
    finally:
        if not was_enabled:
            disable()
