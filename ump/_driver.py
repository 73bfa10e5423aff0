"""The CUDA driver as ump's Python layer reaches it.

Devices, their attributes, primary contexts, free memory and peer access go
through the C core's driver table (csrc/device.c): enabling ump imports no
cuda-bindings, whose driver module alone took ~40 ms of a program's start-up
on the H200 machine. Inter-process events, which only sharing memory
between processes needs, go through cuda-bindings, imported there.
"""

from __future__ import annotations

import contextlib
import ctypes

from . import _core
from ._errors import UmpError

__all__ = ["DriverError", "call", "load", "device_count", "device", "retain", "release", "memory",
           "can_access_peer", "active_devices", "exports_fds", "current", "record_event", "wait_event",
           "destroy_events"]

#: Bytes of a device's name the probe reads (cuDeviceGetName).
NAME_BYTES = 256


class DriverError(UmpError):
    """A CUDA driver call through cuda-bindings failed; ``cuda_error`` names
    CUDA's error. An :class:`UmpError`, so a failure no caller expected
    still reaches users as one of ump's errors."""


def call(fn, *args):
    """``fn(*args)`` of cuda-bindings' driver module: its values, or
    :class:`DriverError` naming CUDA's error."""
    from cuda.bindings import driver

    err, *values = fn(*args)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise DriverError(f"{fn.__name__} failed", name.decode() if name else str(err))
    return values[0] if len(values) == 1 else values


# --- through the C core: no cuda-bindings ----------------------------------------

def load() -> None:
    """Open libcuda.so.1 in the C core (once); UmpError where there is none."""
    _core.cuda_load()


def _made(fn, what: str, *args, ctype=ctypes.c_int) -> int:
    return _core.made(fn, what, *args, ctype=ctype)


def device_count() -> tuple[int, int]:
    """(the driver's version, how many devices it has), after cuInit. Needs
    no CUDA context and makes none."""
    version, count = ctypes.c_int(), ctypes.c_int()
    _core.check(_core.cuda_init(ctypes.byref(version), ctypes.byref(count)), "cuInit failed")
    return version.value, count.value


def device(index: int) -> tuple[str, dict]:
    """(name, fields) of a device: what C reads of it (csrc/ump.h,
    UMP_DEVICE_FIELDS). Needs no CUDA context and makes none."""
    fields, name = _core._CDevice(), ctypes.create_string_buffer(NAME_BYTES)
    _core.check(_core.device_probe(index, ctypes.byref(fields), name, NAME_BYTES), f"reading device {index}")
    return name.value.decode(errors="replace"), {f: getattr(fields, f) for f, _ in fields._fields_}


def exports_fds(device: int) -> bool:
    """Whether the device's VMM memory exports as a POSIX file descriptor."""
    fields = _core._CDevice()
    _core.check(_core.device_probe(device, ctypes.byref(fields), None, 0), f"reading device {device}")
    return bool(fields.posix_fd_handles)


def retain(device: int) -> int:
    """Retain the device's primary context (CuPy's and the runtime's too);
    :func:`release` lets go of it."""
    load()
    return _made(_core.device_retain, f"cuDevicePrimaryCtxRetain failed on device {device}", device,
                 ctype=_core._uptr)


def release(device: int) -> None:
    _core.check(_core.device_release(device), f"cuDevicePrimaryCtxRelease failed on device {device}")


def memory(context: int) -> tuple[int, int]:
    """(free, total) bytes of the device whose context ``context`` is."""
    free, total = _core._u64(), _core._u64()
    _core.check(_core.device_memory(context, ctypes.byref(free), ctypes.byref(total)),
                "cuMemGetInfo failed")
    return free.value, total.value


def can_access_peer(device: int, peer: int) -> bool:
    """Whether kernels on ``device`` can reach memory of ``peer``."""
    return bool(_made(_core.device_can_access_peer, "cuDeviceCanAccessPeer failed", device, peer))


def active_devices(count: int) -> list[int]:
    """The devices (of the first ``count``) on which this process has an
    active primary context (CuPy's or ump's): the only ones that can have
    work of it queued."""
    return [d for d in range(count)
            if _made(_core.device_active, f"cuDevicePrimaryCtxGetState failed on device {d}", d)]


@contextlib.contextmanager
def current(device: int):
    """The device's primary context, current on this thread for the block
    (for driver calls made through cuda-bindings)."""
    ctx = retain(device)
    try:
        _core.check(_core.context_push(ctx), "cuCtxPushCurrent failed")
        try:
            yield ctx
        finally:
            _core.check(_core.context_pop(), "cuCtxPopCurrent failed")
    finally:
        release(device)


# --- stream order across processes: cuda-bindings --------------------------------

def record_event(device: int, stream: int):
    """Record an inter-process event on ``stream``: (event, its 64-byte handle)."""
    from cuda.bindings import driver

    flags = driver.CUevent_flags.CU_EVENT_INTERPROCESS | driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
    with current(device):
        ev = call(driver.cuEventCreate, flags)
        try:
            call(driver.cuEventRecord, ev, stream)
            return ev, bytes(call(driver.cuIpcGetEventHandle, ev).reserved)
        except BaseException:
            call(driver.cuEventDestroy, ev)
            raise


def wait_event(device: int, data: bytes, stream: int) -> None:
    """Make ``stream`` wait for another process's event."""
    from cuda.bindings import driver

    with current(device):
        h = driver.CUipcEventHandle()
        h.reserved = data
        ev = call(driver.cuIpcOpenEventHandle, h)
        try:
            call(driver.cuStreamWaitEvent, stream, ev, 0)
        finally:
            call(driver.cuEventDestroy, ev)


def destroy_events(device: int, events) -> None:
    from cuda.bindings import driver

    with current(device):
        for ev in events:
            call(driver.cuEventDestroy, ev)
