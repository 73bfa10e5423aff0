"""User-facing functions that act on arrays: identity, transfers, placement."""

from __future__ import annotations

import numpy

from . import _core, _enable
from ._cupy_hook import GPU_KINDS, _block_of, advice_code
from ._errors import UmpError
from ._options import check_device_index

__all__ = ["kind_of", "statistics", "trim", "asarray", "asnumpy", "prefetch", "advise", "synchronize",
           "migrate"]


def _is_cupy_array(obj) -> bool:
    return type(obj).__module__.startswith("cupy") and hasattr(obj, "data") and hasattr(obj.data, "ptr")


def _address(obj) -> int:
    if isinstance(obj, bool):
        raise TypeError("kind_of() takes an array or an integer address, not bool")
    if isinstance(obj, int):
        if obj < 0:
            raise ValueError(f"an address cannot be negative: {obj}")
        return obj
    if isinstance(obj, numpy.ndarray):
        return obj.__array_interface__["data"][0]
    if _is_cupy_array(obj):
        return obj.data.ptr
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        iface = getattr(obj, attr, None)
        if isinstance(iface, dict) and isinstance(iface.get("data"), tuple):
            return int(iface["data"][0])
    raise TypeError(f"kind_of() takes an array or an integer address, not {type(obj).__name__!r}")


def kind_of(obj) -> str | None:
    """Which kind of ump memory holds ``obj``.

    Parameters
    ----------
    obj : array or int
        A NumPy or CuPy array, anything with an array interface, or an address.

    Returns
    -------
    str or None
        ``"system"``, ``"managed"``, ``"pinned"``, ``"device"``, ``"host"``
        (no GPU in the process), or None for memory ump does not own.

    Raises
    ------
    TypeError, ValueError
        ``obj`` is neither an array nor a non-negative integer address.
    """
    return _core.lookup(_address(obj))[0]


def statistics() -> dict:
    """Statistics of the enabled backend's arenas (``"numpy"``, ``"cupy"``),
    of its VMM pool (``"pool"``, backend ``"device"``: a
    :class:`ump.VMMStatistics`) and of the plain fallback memory
    (``"fallback"``)."""
    state = _enable.current()
    out = {"fallback": _core.fallback_statistics()}
    if state is not None:
        out["numpy"] = state.numpy_arena.statistics()
        if state.cupy_arena is not None:
            out["cupy"] = state.cupy_arena.statistics()
        if state.cupy is not None and state.cupy.copies:
            out["pool"] = state.cupy.pool.statistics()
    return out


def trim() -> None:
    """Give the enabled backend's wholly free chunks back to the driver/OS,
    after releasing CuPy's cached blocks."""
    state = _require()
    if state.cupy is not None:
        state.cupy.synchronize()
        state.cupy.pool.free_all_blocks()
    state.numpy_arena.trim()
    if state.cupy_arena is not None:
        state.cupy_arena.trim()


def _require(gpu: bool = False):
    state = _enable.current()
    if state is None:
        raise UmpError("ump is not enabled: call ump.enable() first")
    if gpu and state.cupy is None:
        raise UmpError(f"the {state.backend.name!r} backend has no GPU side")
    return state


def asarray(obj):
    """A CuPy array sharing ``obj``'s memory where ump can, else a copy.

    Parameters
    ----------
    obj : numpy.ndarray or cupy.ndarray

    Raises
    ------
    TypeError
        ``obj`` is not an array.
    UmpError
        ump is not enabled with a GPU backend.
    """
    # The argument is checked first, so a wrong type is reported as such
    # whatever the state of ump.
    if not (_is_cupy_array(obj) or isinstance(obj, numpy.ndarray)):
        raise TypeError(f"ump.asarray() takes a NumPy or CuPy array, not {type(obj).__name__!r}")
    state = _require(gpu=True)
    if _is_cupy_array(obj):
        return obj
    return state.cupy.array(obj, copy=None)


def asnumpy(obj, stream=None):
    """A NumPy array sharing a CuPy array's memory where ump can, else a copy;
    waits for the GPU work first. Unlike ``cupy.asnumpy``, it also shares
    the small arrays CuPy made in managed memory, whose pages the host's
    reads then fault over from the GPU."""
    state = _require(gpu=True)
    if isinstance(obj, numpy.ndarray):
        return obj
    if not _is_cupy_array(obj):
        raise TypeError(f"ump.asnumpy() takes a CuPy or NumPy array, not {type(obj).__name__!r}")
    return state.cupy.get(obj, stream=stream, order="A", share_results=True)


def _managed_range(array):
    if isinstance(array, numpy.ndarray):
        ptr, shape, strides, item = _address(array), array.shape, array.strides, array.itemsize
    elif _is_cupy_array(array):
        ptr, shape, strides, item = array.data.ptr, array.shape, array.strides, array.itemsize
    else:
        raise TypeError(f"expected a NumPy or CuPy array, not {type(array).__name__!r}")
    found = _block_of(ptr, shape, strides, item, kinds=GPU_KINDS)
    if found is None or found[0] != "managed":
        kind = _core.lookup(ptr)[0]
        raise UmpError(f"prefetch and advice need managed memory; this array's memory is {kind or 'not ump'}'s")
    _, _, _, lo, hi, _ = found
    return lo, hi - lo


def prefetch(array, to: str = "gpu", stream=None) -> None:
    """Migrate a managed array's pages to the GPU or the host, in stream order.

    Parameters
    ----------
    array : numpy.ndarray or cupy.ndarray
    to : {"gpu", "host"}
    stream : cupy.cuda.Stream, optional
        Defaults to CuPy's current stream.

    Notes
    -----
    On the H200 a prefetch of 1 GiB to the GPU runs at the link's speed
    (21 ms), against 257 ms for the same pages moved by faults.
    """
    state = _require(gpu=True)
    if to not in ("gpu", "host"):
        raise ValueError(f"to must be 'gpu' or 'host', got {to!r}")
    lo, size = _managed_range(array)
    cupy = state.cupy.cupy
    s = stream if stream is not None else cupy.cuda.get_current_stream()
    _core.prefetch(lo, size, state.options.device if to == "gpu" else -1, s.ptr)


def advise(array, advice: str, device: int | str | None = None) -> None:
    """cudaMemAdvise on a managed array's range.

    Parameters
    ----------
    advice : str
        ``"preferred_location"``, ``"accessed_by"``, ``"read_mostly"`` or
        their ``"unset_..."`` forms.
    device : int or "host", optional
        The location the advice names; default the enabled device.
    """
    state = _require(gpu=True)
    code = advice_code(advice)
    if device is None:
        device = state.options.device
    if device == "host":
        device = -1
    if isinstance(device, bool) or not isinstance(device, int) or device < -1:
        raise ValueError(f"device must be a device index or 'host', got {device!r}")
    lo, size = _managed_range(array)
    _core.advise(lo, size, code, device)


def synchronize() -> None:
    """Wait for the device's GPU work and release NumPy memory that CuPy
    views no longer use.

    Raises
    ------
    UmpError
        (a ``RuntimeError``, as CuPy's refusal of a host transfer then) The
        current stream is capturing a CUDA graph: a wait would invalidate
        the capture.
    """
    state = _require()
    if state.cupy is not None:
        state.cupy.synchronize()


def migrate(array, device: int):
    """Move the device memory under a VMM-pool array to another GPU, keeping
    its address.

    The physical chunks under the array are copied to ``device``, mapped at
    the same virtual addresses, and every device of the pool (the new one
    included) is granted access, after all of them finished their work.

    Parameters
    ----------
    array : cupy.ndarray or int
        An array in a :class:`ump.VMMPool` (``backend="device"``), or an
        address in one.
    device : int
        The GPU to move to; it must be able to reach the pool's device and
        the other way round (cuDeviceCanAccessPeer).

    Returns
    -------
    The array, for a CuPy array one whose memory reports ``device``: it is
    the same memory at the same address.

    Raises
    ------
    TypeError
        ``array`` is not an array or an address.
    ValueError
        ``device`` is not a device of this machine.
    UmpError
        The memory is not in a VMM pool, or the devices cannot reach each
        other.
    """
    from . import _vmm

    ptr = _address(array)
    check_device_index(device)
    kind, base, size, _ = _core.lookup_owner(ptr)
    pool = _vmm.pool_of(ptr)
    if pool is None:
        raise UmpError("ump.migrate() moves memory of a VMM pool (backend='device' or ump.VMMPool); "
                       f"this memory is {kind or 'not ump'}'s")
    pool.migrate(base, size, device)  # grant() checks that the device exists
    if _is_cupy_array(array) and array.data.device_id != device:
        import cupy

        mem = cupy.cuda.memory.UnownedMemory(array.data.ptr, array.nbytes, array, device)
        return cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(mem, 0), array.strides)
    return array
