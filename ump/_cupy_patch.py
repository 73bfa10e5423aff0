"""The CuPy patch set: what ump replaces in CuPy while it is enabled.

``cupy._core.array`` (behind ``cupy.array`` and ``cupy.asarray``) and, on
``cupy.ndarray``, ``get``, ``__array_interface__``, ``__array__``,
``__cuda_array_interface__``, ``__dlpack__``, ``__dlpack_device__``,
``toDlpack``, (Python >= 3.12) ``__buffer__``, and the conversions to a
Python scalar (``__bool__``, ``__int__``, ``__float__``, ``__complex__``,
``item``): each replacement calls the hook's conversion (ump/_cupy_hook.py),
which calls CuPy's original where ump has nothing to add. The streams CuPy
makes are noted (``note_streams``: whether one is non-blocking). Where the
placement policy weighs waits (backend ``managed``, placement ``auto``), the
program's own waits too (``wrap_waits``): a stream's ``synchronize``,
``cupy.cuda.runtime.deviceSynchronize`` and, with one GPU, an event's
``synchronize`` and the wait that CuPy announces to its synchronisation
detection (``Device.synchronize()``, a compiled method that cannot be
replaced, announces its wait there first).
``restore()`` puts back exactly what was there (``_cupy_compat.Patches``).
"""

from __future__ import annotations

import functools
import sys

import numpy

from ._cupy_compat import Patches, waiting_itself

__all__ = ["CupyPatches"]


class CupyPatches:
    """CuPy's entry points, replaced by calls into ``hook``'s conversions.

    Attributes
    ----------
    original : dict
        CuPy's own ``array``, ``get``, ``__dlpack__``, ``__dlpack_device__``
        and ``toDlpack``, which the conversions fall back on.
    """

    def __init__(self, cupy, hook):
        self.cupy = cupy
        self.hook = hook
        self.original = {}
        self._patches = None

    def install(self) -> None:
        """Replace CuPy's entry points; restorable from the first change on."""
        cupy, nd = self.cupy, self.cupy.ndarray
        self.original.update(array=cupy._core.array, get=nd.get, __dlpack__=nd.__dlpack__,
                             __dlpack_device__=nd.__dlpack_device__, toDlpack=nd.toDlpack)
        methods = self._methods(nd.__cuda_array_interface__)
        patches = self._patches = Patches()
        patches.set(cupy._core, "array", self.hook.array)
        for name, value in methods.items():
            patches.set(nd, name, value)

    def note_streams(self) -> None:
        """After :meth:`install`: tell the hook's ``side_streams`` of each
        stream object CuPy makes (``Stream``, ``ExternalStream`` and
        ``Stream.from_external`` all run the base class's ``__init__``);
        :meth:`restore` undoes this too."""
        hook, base = self.hook, self.hook.side_streams.base
        init = base.__init__

        @functools.wraps(init)
        def stream_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            hook.side_streams.note(self)

        self._patches.set(base, "__init__", stream_init)

    def wrap_waits(self) -> None:
        """After :meth:`install`: time the waits the program asks CuPy for
        (``hook.program_wait``); :meth:`restore` undoes these too."""
        hook, cuda, patches = self.hook, self.cupy.cuda, self._patches
        runtime = cuda.runtime
        # The class that defines it: Stream and ExternalStream share it.
        streams = next(k for k in cuda.Stream.__mro__ if "synchronize" in vars(k))
        stream_wait, device_wait = streams.synchronize, runtime.deviceSynchronize

        @functools.wraps(stream_wait)
        def stream_synchronize(self):
            return hook.program_wait(lambda: stream_wait(self), self.device_id)

        @functools.wraps(device_wait)
        def device_synchronize():
            return hook.program_wait(device_wait)

        # ump's own device waits call CuPy's directly (ReleaseQueue.wait_for);
        # a wrapper another library puts on top copies this, and is told
        # apart by the first item.
        device_synchronize.ump_wrapped = (device_synchronize, device_wait)
        patches.set(streams, "synchronize", stream_synchronize)
        patches.set(runtime, "deviceSynchronize", device_synchronize)
        if runtime.getDeviceCount() != 1:
            # An event names no device, and Device(k).synchronize() may wait
            # for another GPU than the current one: neither is weighed.
            return
        event_wait = cuda.Event.synchronize

        @functools.wraps(event_wait)
        def event_synchronize(self):
            return hook.program_wait(lambda: event_wait(self))

        patches.set(cuda.Event, "synchronize", event_synchronize)
        syncdetect = getattr(self.cupy._core, "syncdetect", None)
        if syncdetect is None:
            return
        declare = syncdetect._declare_synchronize

        @functools.wraps(declare)
        def declare_synchronize():
            declare()  # raises where cupyx.allow_synchronize(False) says so
            if not waiting_itself():
                # Device.synchronize() (a compiled method) calls this just
                # before its wait, the one GPU's: ump takes the wait here,
                # timed, and CuPy's own then finds the device idle. CuPy's
                # ndarray.get() calls it too, before its copy; ump's get()
                # runs CuPy's inside OwnWaits, so no wait is added there.
                hook.program_wait(device_wait)

        patches.set(syncdetect, "_declare_synchronize", declare_synchronize)

    def restore(self) -> None:
        if self._patches is not None:
            self._patches.restore()

    def _methods(self, cai) -> dict:
        """The replacements of ``cupy.ndarray``'s attributes, by name; ``cai``
        is CuPy's own ``__cuda_array_interface__`` property."""
        hook, original = self.hook, self.original

        def get(self, stream=None, order="C", out=None, blocking=True):
            return hook.get(self, stream=stream, order=order, out=out, blocking=blocking)

        def array_interface(self):
            iface = hook.export(self)
            if iface is None:
                raise AttributeError("__array_interface__: this CuPy array is not in host-visible "
                                     "ump memory")
            return iface

        def array_(self, dtype=None, copy=None):
            return hook.host_array(self, dtype, copy)

        def cuda_array_interface(self):
            # A wait for the whole device, whatever ump.enable(sync=...)
            # says: the stream CuPy names is only the current one, and the
            # array may have been written on any.
            waited = hook.wait_before_gpu_export(self)
            desc = cai.__get__(self)
            # The device is done with the array, so no stream is named for
            # the consumer to wait on. A stream named would also become
            # Numba's stream for the array, on which its copy_to_host() is
            # asynchronous: into ump's NumPy memory (pinned or managed) it
            # returns before the copy has ended (stock NumPy memory is
            # pageable, and the copy into it returns when done). While a
            # graph is captured CuPy's stream stays: the consumer's work is
            # captured on it.
            if waited and "stream" in desc:
                desc["stream"] = None
            return desc

        def dlpack(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            return hook.dlpack(self, stream=stream, max_version=max_version, dl_device=dl_device,
                               copy=copy)

        def dlpack_device(self):
            return hook.dlpack_device(self)

        def to_dlpack(self):
            hook.wait_before_gpu_export(self)
            return hook.cuda_capsule(self, original["toDlpack"](self))

        for fn, like in ((get, original["get"]), (dlpack, original["__dlpack__"]),
                         (to_dlpack, original["toDlpack"])):
            fn.__doc__ = like.__doc__
        methods = {"get": get, "__array_interface__": property(array_interface), "__array__": array_,
                   "__cuda_array_interface__": property(cuda_array_interface), "__dlpack__": dlpack,
                   "__dlpack_device__": dlpack_device, "toDlpack": to_dlpack}
        if sys.version_info >= (3, 12):
            def buffer(self, flags):
                view = hook.host_view(self)
                if view is None:
                    raise BufferError("this CuPy array is in device memory, which the host cannot "
                                      "read in place: use cupy.asnumpy()")
                return memoryview(view)

            methods["__buffer__"] = buffer
        methods.update(self._scalars(self.cupy.ndarray))
        return methods

    def _scalars(self, nd) -> dict:
        """The conversions of a one-element array to a Python scalar, which
        copy the element (``hook.scalar``) rather than read it in place."""
        hook, methods = self.hook, {}

        def convert(name, to):
            original = getattr(nd, name)

            def method(self):
                x = hook.scalar(self, to)
                return original(self) if x is None else x

            method.__name__, method.__doc__ = name, original.__doc__
            return method

        for name, to in (("__bool__", bool), ("__int__", int), ("__float__", float),
                         ("__complex__", complex), ("item", numpy.ndarray.item)):
            methods[name] = convert(name, to)
        return methods
