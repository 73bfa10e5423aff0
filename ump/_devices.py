"""What ump keeps per GPU for the life of the process, as RMM keeps a
resource per device: the primary context it retained there, the VMM pool
``backend="device"`` allocates from, and the arena CuPy allocates from on a
GPU other than the enabled one.

Contexts and pools outlive ``disable()``: arrays made while enabled still
use their memory, and enabling again reuses them. The arenas of other GPUs
are made again at each ``enable()``, under its options (the C core hands
back the same arenas).
"""

from __future__ import annotations

import threading

from . import _driver
from ._errors import UmpError

__all__ = ["context", "vmm_pool", "existing_vmm_pool", "cupy_arena", "forget_cupy_arenas"]

_lock = threading.RLock()
_contexts: dict[int, int] = {}  # device -> its primary context, retained once
_pools: dict = {}  # device -> VMMPool
_cupy_arenas: dict = {}  # device -> _core.Arena


def context(device: int) -> tuple[int, int, int]:
    """The device's primary context (CuPy's too), retained once for the
    process; (context, free bytes, total bytes).

    Raises
    ------
    UmpError
        The driver could not set the context up; ``cuda_error`` names why
        (a GPU without room for a context: ``CUDA_ERROR_OUT_OF_MEMORY``).
    """
    with _lock:
        try:
            ctx = _contexts.get(device)
            if ctx is None:
                ctx = _contexts[device] = _driver.retain(device)
            free, total = _driver.memory(ctx)
        except UmpError as err:
            hint = ": the GPU has no room for a CUDA context; free memory on it" if (
                err.cuda_error == "CUDA_ERROR_OUT_OF_MEMORY") else ""
            raise UmpError(f"setting up the CUDA context of device {device}{hint}: {err.message}",
                           err.cuda_error) from err
    return ctx, free, total


def _new_pool(device: int, **limits):
    """A VMM pool for CuPy on ``device``, reachable from every GPU that can
    reach it: stock CuPy's memory is, once CuPy enables peer access (which it
    does by itself for a cross-device copy), and cudaDeviceEnablePeerAccess
    does not reach VMM mappings."""
    from ._probe import probe
    from ._vmm import VMMPool

    pool = VMMPool(device, **limits)
    try:
        for peer in range(len(probe().devices)):
            if peer != device and _driver.can_access_peer(peer, device) and _driver.can_access_peer(device, peer):
                pool.grant(peer)
    except BaseException:
        pool.close()
        raise
    return pool


def existing_vmm_pool(device: int):
    """The device's VMM pool if one was made, else None."""
    return _pools.get(device)


def vmm_pool(device: int, **limits):
    """The device's VMM pool, made at its first use (``limits`` go to
    :class:`ump.VMMPool` then; by default it is bounded by the device's
    memory)."""
    with _lock:
        pool = _pools.get(device)
        if pool is None:
            pool = _pools[device] = _new_pool(device, **limits)
        return pool


def cupy_arena(device: int, make):
    """The arena CuPy allocates from on ``device``, made by
    ``make(context, free, total)`` at its first use since the last
    :func:`forget_cupy_arenas`."""
    with _lock:
        arena = _cupy_arenas.get(device)
        if arena is None:
            arena = _cupy_arenas[device] = make(*context(device))
        return arena


def forget_cupy_arenas() -> None:
    with _lock:
        _cupy_arenas.clear()
