"""The pieces of ump/_cupy_compat.py that run without CuPy: DLPack capsule
rewriting and finding a compiled module's private C variable."""

from __future__ import annotations

import ctypes
import functools
import gc
import struct
import threading

import numpy as np
import pytest

import ump
from ump import _core, _cupy_compat, _ucore


class _Producer:
    """A DLPack producer whose capsule ump rewrote to ``device_type``."""

    def __init__(self, array, device_type, versioned):
        self.array, self.device_type, self.versioned = array, device_type, versioned

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        capsule = self.array.__dlpack__(max_version=(1, 0)) if self.versioned else self.array.__dlpack__()
        _cupy_compat.set_capsule_device(capsule, self.device_type)
        return capsule


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "legacy"])
def test_set_capsule_device_rewrites_the_device_type(versioned):
    a = np.arange(10.0)
    # NumPy reads kDLCPU and the host-readable kDLCUDAManaged, at the same address
    for device_type in (_cupy_compat.KDL_CPU, _cupy_compat.KDL_CUDA_MANAGED):
        b = np.from_dlpack(_Producer(a, device_type, versioned))
        assert b.ctypes.data == a.ctypes.data and b[3] == 3.0
    # and refuses kDLCUDA: so the byte written is the device type
    with pytest.raises((BufferError, RuntimeError), match="[Uu]nsupported device"):  # NumPy 2.5 / 2.4
        np.from_dlpack(_Producer(a, _cupy_compat.KDL_CUDA, versioned))


def test_set_capsule_device_refuses_other_objects():
    with pytest.raises(ump.UmpError, match="DLPack capsule"):
        _cupy_compat.set_capsule_device(object(), _cupy_compat.KDL_CUDA)


def test_elf_symbol_finds_a_private_variable():
    """The lookup ump uses for CuPy's flags, on ump's own extension: the
    budgets (a static array in csrc/arena.c: {int kind, int device,
    uint64 held, uint64 cap} each) hold the cap just set."""
    found = _cupy_compat._elf_symbol(_ucore.__file__, b"budgets")
    assert found is not None
    offset, size = found
    assert size == 24 * _core.MAX_ARENAS  # at most one budget per arena
    cap = 48 << 20
    _core.Arena("host", _core.PROVIDER_HOST, cap)
    base = _cupy_compat._load_base(_ucore)
    entries = [(ctypes.c_int32.from_address(base + offset + 24 * i).value,
                ctypes.c_int32.from_address(base + offset + 24 * i + 4).value,
                ctypes.c_uint64.from_address(base + offset + 24 * i + 16).value)
               for i in range(_core.MAX_ARENAS)]
    assert (_core.KIND_IDS["host"], -1, cap) in entries
    # A shorter tail of the name finds the same symbol; the name's head, none.
    assert _cupy_compat._elf_symbol(_ucore.__file__, b"udgets") == found
    assert _cupy_compat._elf_symbol(_ucore.__file__, b"budget") is None
    assert _cupy_compat._elf_symbol(_ucore.__file__, b"no_such_symbol_in_ump") is None


def _symbols_in_order(path):
    """(name, value, size) of every symbol of the ELF file's symbol tables,
    in table order, unpacked one by one: what the lookup must agree with."""
    with open(path, "rb") as f:
        data = f.read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind == 2:  # SHT_SYMTAB
            strtab = sections[link][4]
            for at in range(offset, offset + size, entsize):
                name, _, _, _, value, sym_size = struct.unpack_from("<IBBHQQ", data, at)
                yield data[strtab + name:data.index(b"\0", strtab + name)], value, sym_size


def test_elf_symbol_finds_the_first_symbol_ending_with_each_tail():
    """Every name of ump's extension, whole and its second half: the first
    symbol in table order whose name ends with it, as a one-by-one scan
    finds it. Linkers store a name inside a longer one that ends the same
    (csrc/module.c's `kinds` inside `view_kinds`), so the tails test that."""
    symbols = [s for s in _symbols_in_order(_ucore.__file__) if s[0]]
    assert len(symbols) > 100
    for tail in {t for name, _, _ in symbols for t in (name, name[len(name) // 2:])}:
        first = next((value, size) for name, value, size in symbols if name.endswith(tail))
        assert _cupy_compat._elf_symbol(_ucore.__file__, tail) == first, tail


def test_patches_restore_what_was_there():
    class Base:
        def method(self):
            return "base"

    class Child(Base):
        own = 1

    patches = _cupy_compat.Patches()
    patches.set(Child, "method", lambda self: "patched")
    patches.set(Child, "own", 2)
    assert Child().method() == "patched" and Child.own == 2
    patches.restore()
    assert Child().method() == "base" and "method" not in Child.__dict__ and Child.own == 1


def test_sync_declarer_goes_through_cupys_sync_detection():
    """ump's waits raise where ``cupyx.allow_synchronize(False)`` is in force
    (a stand-in for cupy._core.syncdetect; the GPU test uses CuPy's own)."""
    import types

    class Disallowed(RuntimeError):
        pass

    allowed = {"now": True}

    def declare():
        if not allowed["now"]:
            raise Disallowed

    cupy = types.SimpleNamespace(_core=types.SimpleNamespace(
        syncdetect=types.SimpleNamespace(_declare_synchronize=declare)))
    declare = _cupy_compat.sync_declarer(cupy)
    declare()
    allowed["now"] = False
    with pytest.raises(Disallowed):
        declare()
    # a CuPy without sync detection: nothing to declare to
    _cupy_compat.sync_declarer(types.SimpleNamespace(_core=types.SimpleNamespace()))()


def test_scalar_conversions_copy_through_the_hook_and_fall_back_to_cupys():
    """bool(), int(), float(), complex() and item() ask the hook for a copy
    of the element first (managed memory: no host read in place), and use
    CuPy's own conversion where it has none; restore() gives CuPy's back."""
    from ump._cupy_patch import CupyPatches

    class Base:  # CuPy's _ndarray_base: each conversion goes through get()
        def get(self, stream=None, order="C", out=None, blocking=True):
            return np.float64(self.value)

        def __bool__(self):
            return bool(self.get())

        def __int__(self):
            return int(self.get())

        def __float__(self):
            return float(self.get())

        def __complex__(self):
            return complex(self.get())

        def item(self):
            return self.get().item()

        for name in ("__dlpack__", "__dlpack_device__", "toDlpack"):
            locals()[name] = lambda self, *a, **k: None
        __cuda_array_interface__ = property(lambda self: {})

    class ndarray(Base):
        def __init__(self, value):
            self.value = value

    class Hook:
        copied, got = [], []

        def scalar(self, g, to):  # ``to`` of a copy of the element, or None: not managed memory
            self.copied.append(g.value)
            return None if g.value < 0 else to(np.array(g.value + 0.5))

        def get(self, g, **kwargs):
            self.got.append(g.value)
            return np.float64(g.value)

        def array(self, *args, **kwargs):
            raise AssertionError("not called here")

    cupy = type("cupy", (), {"ndarray": ndarray, "_core": type("core", (), {"array": None})})
    hook = Hook()
    patches = CupyPatches(cupy, hook)
    patches.install()
    try:
        assert [bool(ndarray(0)), int(ndarray(2)), float(ndarray(2)), complex(ndarray(2)),
                ndarray(2).item()] == [True, 2, 2.5, 2.5 + 0j, 2.5]
        assert hook.got == []  # nothing read in place
        assert [bool(ndarray(-1)), int(ndarray(-3)), ndarray(-3).item()] == [True, -3, -3.0]
        assert hook.got == [-1, -3, -3]  # CuPy's own, through the patched get()
    finally:
        patches.restore()
    assert float(ndarray(2)) == 2.0 and "__float__" not in ndarray.__dict__ and len(hook.copied) == 8


def test_a_scalar_conversion_keeps_nothing_of_the_reused_buffer():
    """A scalar read converts a view of the pinned buffer its element was
    copied into, and reuses the buffer for the next read: nothing returned
    may still view it. ``item()`` of a structured element returns its
    subarray fields as arrays, so that element is copied first."""
    from ump._cupy_hook import _converted

    buffer = bytearray(64)
    fields = np.dtype([("a", "f8", (2,)), ("b", "i4")])
    np.frombuffer(buffer, fields, 1)[0] = ((1.0, 2.0), 3)
    got = _converted(buffer, fields, (), np.ndarray.item)
    read = [_converted(buffer, np.dtype("f8"), (), float)]
    buffer[0] = 1
    read.append(_converted(buffer, np.dtype("?"), (1,), bool))
    buffer[:] = bytes(64)  # the next read's copy
    assert got[0].tolist() == [1.0, 2.0] and got[1] == 3
    assert read == [1.0, True]
    try:  # int() of a one-element 1-d array: as NumPy answers it for get()'s array
        expected = int(np.zeros(1))
    except (TypeError, DeprecationWarning):
        with pytest.raises((TypeError, DeprecationWarning)):
            _converted(buffer, np.dtype("f8"), (1,), int)
    else:
        assert _converted(buffer, np.dtype("f8"), (1,), int) == expected


class _Waits:
    """Stand-ins for CuPy's waits (a stream's, an event's, the device's,
    and its synchronisation detection), each recording what waited."""

    def __init__(self, gpus: int):
        import types

        self.waited, self.allowed = [], True  # ("stream", device), ("event",), ("device",)
        waits = self

        class BaseStream:  # CuPy's _BaseStream defines synchronize; Stream inherits it
            def __init__(self, device_id):
                self.device_id = device_id

            def synchronize(self):
                waits.waited.append(("stream", self.device_id))

        class Event:
            def synchronize(self):
                waits.waited.append(("event",))

        self.BaseStream, self.Stream = BaseStream, type("Stream", (BaseStream,), {})
        self.stream_wait = BaseStream.synchronize
        runtime = types.SimpleNamespace(deviceSynchronize=self.device_synchronize,
                                        getDevice=lambda: 3, getDeviceCount=lambda: gpus)
        ndarray = type("ndarray", (), {name: (lambda self, *a, **k: None) for name in (
            "get", "__dlpack__", "__dlpack_device__", "toDlpack", "__bool__", "__int__",
            "__float__", "__complex__", "item")})
        ndarray.__cuda_array_interface__ = property(lambda self: {})
        self.cupy = types.SimpleNamespace(
            ndarray=ndarray, cuda=types.SimpleNamespace(Stream=self.Stream, Event=Event, runtime=runtime),
            _core=types.SimpleNamespace(array=None, syncdetect=types.SimpleNamespace(
                _declare_synchronize=self.declare)))

    def declare(self):
        if not self.allowed:
            raise RuntimeError("DeviceSynchronized")

    def device_synchronize(self):
        self.waited.append(("device",))

    def hook(self, weighed: list):
        """The hook's own wait methods over these stand-ins (no GPU here),
        the placement's ``on_sync`` recording into ``weighed``."""
        import types

        from ump._cupy_hook import CupyHook

        hook = CupyHook.__new__(CupyHook)
        hook.cupy, hook.array = self.cupy, None
        hook.placement = types.SimpleNamespace(on_sync=lambda device, seconds, exclude, ended:
                                               weighed.append((device, seconds >= 0, exclude)))
        return hook


def test_the_programs_waits_are_timed_for_the_placement_and_umps_own_are_not():
    """``wrap_waits()``: a stream's, an event's and the runtime's
    synchronize and CuPy's synchronisation-detection hook (where the
    compiled ``Device.synchronize()`` announces its wait) reach the
    placement policy; ump's own waits (``OwnWaits``) do not, and a
    disallowed wait raises before anything waits. ``restore()`` gives
    CuPy's back."""
    from ump._cupy_compat import OwnWaits
    from ump._cupy_patch import CupyPatches

    stand_in, weighed = _Waits(gpus=1), []
    cupy, Stream = stand_in.cupy, stand_in.Stream
    hook = stand_in.hook(weighed)
    patches = CupyPatches(cupy, hook)
    patches.install()
    patches.wrap_waits()
    try:
        Stream(1).synchronize()
        Stream(-1).synchronize()  # CuPy's null stream names device -1: the current one
        cupy.cuda.Event().synchronize()
        cupy.cuda.runtime.deviceSynchronize()
        cupy._core.syncdetect._declare_synchronize()  # Device.synchronize() is about to wait
        assert stand_in.waited == [("stream", 1), ("stream", -1), ("event",)] + [("device",)] * 2
        assert weighed == [(1, True, None)] + [(3, True, None)] * 4
        with OwnWaits():  # ump's own: they wait, uncounted; the announced one is left to CuPy
            Stream(1).synchronize()
            cupy.cuda.runtime.deviceSynchronize()
            cupy._core.syncdetect._declare_synchronize()
        assert len(stand_in.waited) == 7 and len(weighed) == 5
        stand_in.allowed = False  # cupyx.allow_synchronize(False)
        with pytest.raises(RuntimeError, match="DeviceSynchronized"):
            cupy._core.syncdetect._declare_synchronize()
        assert len(stand_in.waited) == 7
    finally:
        patches.restore()
    assert "synchronize" not in Stream.__dict__ and stand_in.BaseStream.synchronize is stand_in.stream_wait
    assert cupy.cuda.runtime.deviceSynchronize == stand_in.device_synchronize
    assert cupy._core.syncdetect._declare_synchronize == stand_in.declare
    Stream(0).synchronize()
    assert len(weighed) == 5  # CuPy's own again


def test_umps_own_wait_reaches_the_placement_once():
    """The hook's wait (an export's, a scalar read's) is reported to the
    placement by the hook itself, once: the release queue's device wait
    under it passes the program's-wait wrapper uncounted."""
    import types

    from ump._cupy_patch import CupyPatches
    from ump._release import ReleaseQueue

    stand_in, weighed = _Waits(gpus=1), []
    hook = stand_in.hook(weighed)
    hook._declare_synchronize, hook.options = (lambda: None), types.SimpleNamespace(sync="device")
    patches = CupyPatches(stand_in.cupy, hook)
    patches.install()
    patches.wrap_waits()
    try:
        hook.release = ReleaseQueue(stand_in.cupy, device_count=1)
        assert hook._wait(None, None, exporting=(0x1000, 4096)) >= 0
        assert stand_in.waited == [("device",)] and weighed == [(3, True, (0x1000, 4096))]
        # another library's wrapper on top of ump's: it runs, and the wait is still weighed once
        runtime, traced = stand_in.cupy.cuda.runtime, []
        ump_wait = runtime.deviceSynchronize

        @functools.wraps(ump_wait)
        def tracer():
            traced.append(1)
            return ump_wait()

        runtime.deviceSynchronize = tracer
        hook._wait(None, None, exporting=(0x1000, 4096))
        runtime.deviceSynchronize = ump_wait
        assert traced == [1] and len(weighed) == 2
    finally:
        patches.restore()


def test_with_several_gpus_events_and_the_announced_device_wait_are_left_to_cupy():
    """An event names no device, and ``Device(k).synchronize()`` may wait for
    another GPU than the current one: with several GPUs ump leaves both
    alone and weighs a stream's wait on its own device."""
    from ump._cupy_patch import CupyPatches

    stand_in, weighed = _Waits(gpus=2), []
    event_wait = stand_in.cupy.cuda.Event.synchronize
    patches = CupyPatches(stand_in.cupy, stand_in.hook(weighed))
    patches.install()
    patches.wrap_waits()
    try:
        assert stand_in.cupy._core.syncdetect._declare_synchronize == stand_in.declare
        assert stand_in.cupy.cuda.Event.synchronize is event_wait
        stand_in.cupy._core.syncdetect._declare_synchronize()
        stand_in.cupy.cuda.Event().synchronize()
        stand_in.Stream(1).synchronize()
        assert stand_in.waited == [("event",), ("stream", 1)] and weighed == [(1, True, None)]
    finally:
        patches.restore()


def _stream_classes():
    """Stand-ins for CuPy's stream classes: the base class whose ``__init__``
    every stream object runs, ``Stream`` and its ``from_external``; a
    handle's flags read as CUDA would, an unknown handle's not at all."""
    flags = {}  # handle -> made non-blocking

    class BaseStream:
        def __init__(self, ptr, device_id):
            self.ptr, self.device_id = ptr, device_id

        @property
        def is_non_blocking(self):
            if self.ptr not in flags:
                raise RuntimeError("cudaErrorInvalidResourceHandle")
            return flags[self.ptr]

    class Stream(BaseStream):
        def __init__(self, null=False, non_blocking=False, ptds=False):
            ptr = 0 if null else 2 if ptds else 100 + len(flags)
            if ptr >= 100:
                flags[ptr] = non_blocking
            super().__init__(ptr, -1)

        @classmethod
        def from_external(cls, ptr):
            stream = cls.__new__(cls)
            BaseStream.__init__(stream, ptr, -1)
            return stream

    return BaseStream, Stream


def test_side_streams_say_whether_the_legacy_stream_follows_every_streams_work(monkeypatch):
    """A scalar read queues its copy on the legacy default stream before
    the wait only while no stream it does not follow can have work. The
    first question after ``enable()`` answers yes (that read waits first,
    finishing what was queued unwatched); after it the default handles and
    blocking streams keep the answer no, and a non-blocking stream made
    before ``enable()`` (found by the scan), one made after (noted by the
    patched ``__init__``) and a foreign handle whose flags cannot be read
    make it yes, for good (exports: the next test). A stream object
    with no handle yet (``__new__`` alone) is no work. After an ``enable()``
    that imported CuPy itself nothing ran unwatched: no wait first, no scan."""
    import types

    from ump._cupy_compat import SideStreams
    from ump._cupy_patch import CupyPatches

    BaseStream, Stream = _stream_classes()
    runtime = types.SimpleNamespace(streamLegacy=1, streamPerThread=2)
    ndarray = type("ndarray", (), {name: (lambda self, *a, **k: None) for name in (
        "get", "__dlpack__", "__dlpack_device__", "toDlpack", "__bool__", "__int__", "__float__",
        "__complex__", "item")})
    ndarray.__cuda_array_interface__ = property(lambda self: {})
    cupy = types.SimpleNamespace(ndarray=ndarray, _core=types.SimpleNamespace(array=None),
                                 cuda=types.SimpleNamespace(Stream=Stream, runtime=runtime))
    # held for the whole test, so that the scans find them alive
    defaults = [Stream(null=True), Stream(ptds=True), Stream.from_external(1), Stream.__new__(Stream)]
    blocking = Stream()

    sides = SideStreams(cupy)
    assert sides.base is BaseStream and sides.legacy == 1
    assert sides.unordered_work_possible() is True  # the first question: wait for the unwatched
    assert sides.unordered_work_possible() is False  # the defaults and a blocking stream are followed
    early = Stream(non_blocking=True)
    assert sides.unordered_work_possible() is False  # made while nobody watched ...
    sides.rescan()  # ... and found at the next enable()
    assert sides.unordered_work_possible() is True and sides.unordered_work_possible() is True

    original = BaseStream.__init__
    for make in (lambda: Stream(non_blocking=True), lambda: Stream.from_external(0xdead)):
        del early
        early = None  # the earlier round's non-blocking stream is gone
        sides = SideStreams(cupy)
        sides.unordered_work_possible()
        assert sides.unordered_work_possible() is False
        patches = CupyPatches(cupy, types.SimpleNamespace(side_streams=sides, array=None))
        patches.install()
        patches.note_streams()
        try:
            Stream()  # blocking: still followed
            assert sides.unordered_work_possible() is False
            kept = make()
            assert sides.unordered_work_possible() is True
            del kept
            sides.rescan()  # work on a stream outlives the stream: the answer stays
            sides.unordered_work_possible()
            assert sides.unordered_work_possible() is True
        finally:
            patches.restore()
        assert BaseStream.__init__ is original  # restore() put it back

    def no_scan(*classes):
        raise AssertionError("scanned the collector's objects")

    monkeypatch.setattr(gc, "get_referrers", no_scan)
    sides = SideStreams(cupy)
    sides.rescan(scan=False)
    assert sides.unordered_work_possible() is False and sides.unordered_work_possible() is False
    sides.rescan()
    with pytest.raises(AssertionError, match="scanned"):
        sides.unordered_work_possible()
    assert blocking and defaults


def _side_streams():
    """A SideStreams over stand-in stream classes, past its first question."""
    import types

    from ump._cupy_compat import SideStreams

    _, Stream = _stream_classes()
    sides = SideStreams(types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=Stream, runtime=types.SimpleNamespace(streamLegacy=1, streamPerThread=2))))
    assert sides.unordered_work_possible() is True  # the first question: wait for the unwatched
    assert sides.unordered_work_possible() is False
    return sides


def test_side_streams_keep_the_blocks_handed_to_other_libraries_apart(monkeypatch):
    """An export of an arena's block to another GPU library makes the answer
    yes for that block, for good, and for every block once more than
    ``MAX_EXPORTED`` were; an export of other memory of ump's (VMM pool
    memory, which aliases map twice) makes it yes for every block."""
    from ump._cupy_compat import SideStreams

    sides = _side_streams()
    sides.exported(0x1000)  # another GPU library took ump's block there: its streams are unseen
    assert sides.unordered_work_possible(0x1000) is True
    assert sides.unordered_work_possible(0x2000) is False  # other blocks' reads stay one round trip
    assert sides.unordered_work_possible() is True  # "any block": one was handed over
    sides.rescan(scan=False)
    assert sides.unordered_work_possible(0x1000) is True  # seen once, the answer stays
    assert sides.unordered_work_possible(0x2000) is False
    monkeypatch.setattr(SideStreams, "MAX_EXPORTED", 3)
    for block in (0x2000, 0x3000, 0x2000):
        sides.exported(block)
        assert sides.unordered_work_possible(0x4000) is False  # three blocks kept apart
    sides.exported(0x4000)  # past MAX_EXPORTED: every read waits first
    assert sides.unordered_work_possible(0x5000) is True and sides.seen is True
    sides = _side_streams()
    sides.exported()  # VMM pool memory
    assert sides.unordered_work_possible(0x5000) is True and sides.seen is True


def test_a_copy_on_the_null_stream_is_not_waited_for_first(monkeypatch):
    """``get()`` of an array the host cannot share is CuPy's own copy. A
    small one on CuPy's null stream (the legacy default stream, behind
    every blocking stream's work), with one GPU and no stream that stream
    does not follow that may have work on the array's memory of ump's, is
    the only wait: one round trip to the GPU, as with stock CuPy, weighed
    by the placement as the wait was. Otherwise ump waits for the device
    first: another stream named or current, several GPUs, memory not ump's,
    managed memory of ``prefetch_min`` or more (the placement weighs the
    wait), a block handed to another GPU library (an arena's: that block;
    VMM pool memory: every block), a non-blocking stream. Stand-ins for CuPy and the registry; the GPU tests
    are test_gpu_interop.py's."""
    import types

    from ump import _cupy_hook

    managed, pinned, device, mib = _core.KIND_MANAGED, _core.KIND_IDS["pinned"], _core.KIND_IDS["device"], 1 << 20
    vmm = _core.MAX_ARENAS  # the owner of a VMM pool's memory
    blocks = {0x10000: (managed, 1), 0x20000: (managed, 1), 0x30000: (device, vmm), 0x40000: (0, -1),
              0x50000: (managed, 1), 0x60000: (pinned, 2)}  # kind 0: not ump's
    monkeypatch.setattr(_cupy_hook._core, "lookup_ids", lambda ptr: (
        blocks[ptr & ~0xffff][0], ptr & ~0xffff, mib, blocks[ptr & ~0xffff][1]))
    current = types.SimpleNamespace(ptr=0)
    hook = _cupy_hook.CupyHook.__new__(_cupy_hook.CupyHook)
    hook.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: current, runtime=types.SimpleNamespace(streamIsCapturing=lambda s: False)))
    sides = hook.side_streams = _side_streams()
    gpus = [1]
    hook.release = types.SimpleNamespace(one_gpu=lambda: gpus[0] == 1)
    hook.placement = types.SimpleNamespace(min_bytes=2 * mib)
    calls = []
    hook.synchronize = lambda stream=None, device=None: calls.append("wait first")
    hook._wait = lambda stream, device: calls.append("export's wait")
    hook._weigh = lambda start, device: calls.append("copy weighed")
    hook.patches = types.SimpleNamespace(original={"get": lambda g, **kw: calls.append("copy") or "host copy"})
    hook.host_view = lambda *a, **kw: None  # nothing the host can share

    def array(ptr, nbytes=8 << 10):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr + 64, device_id=0), nbytes=nbytes,
                                     flags=types.SimpleNamespace(c_contiguous=True, f_contiguous=False))

    def get(ptr=0x10000, nbytes=8 << 10, **kwargs):
        calls.clear()
        assert hook.get(array(ptr, nbytes), **kwargs) == "host copy"
        return calls[:]

    one_trip, two = ["copy", "copy weighed"], ["wait first", "copy"]
    assert get() == one_trip and get(0x30000) == one_trip
    assert get(stream=types.SimpleNamespace(ptr=0)) == one_trip  # the null stream named
    assert get(stream=types.SimpleNamespace(ptr=0xbeef)) == two  # a stream of its own
    assert get(0x40000) == two  # memory not ump's: another library's streams may write it
    assert get(nbytes=2 * mib) == two  # a large copy's time is not the kernels'
    assert get(0x60000, nbytes=2 * mib) == one_trip  # but the placement weighs managed memory only
    current.ptr = 2  # the per-thread default stream: it follows the legacy one only
    assert get() == two
    assert get(stream=types.SimpleNamespace(ptr=0)) == two  # the current stream might capture
    current.ptr = 0
    gpus[0] = 2  # another GPU may write it through peer access
    assert get() == two
    gpus[0] = 1
    assert get(blocking=False) == ["copy"]  # nothing is waited for
    hook.wait_before_gpu_export(array(0x40000))  # memory not ump's handed to PyTorch
    hook.wait_before_gpu_export(array(0x20000))  # another block of an arena
    assert get() == one_trip and get(0x30000) == one_trip
    hook.wait_before_gpu_export(array(0x10000))  # this one
    assert get() == two and get(0x30000) == one_trip
    assert get(0x50000) == one_trip
    hook.wait_before_gpu_export(array(0x30000))  # VMM pool memory: aliases map it twice
    assert get(0x30000) == two and get(0x50000) == two and sides.seen is True


def test_get_copies_the_small_results_cupy_made_in_managed_memory(monkeypatch):
    """``get()`` shares what the host can read in place, but copies (CuPy's
    own ``get``) an array CuPy made in managed memory that spans less than
    ``prefetch_min``: a small result, or a small piece of a larger one
    (CuPy's pool also splits a larger free block for a small array).
    Larger results, NumPy's memory, pinned memory and ``share_results``
    (``ump.asnumpy``) are shared. Stand-ins for CuPy and the registry; the
    GPU test is test_gpu_interop.py's."""
    import types

    from ump import _cupy_hook

    memory = np.zeros(8 << 20, dtype=np.uint8)  # what the stand-in arrays view
    base, numpy_arena, cupy_arena, mib = memory.ctypes.data, 1, 2, 1 << 20
    blocks = [("managed", base, 4 * mib, cupy_arena), ("managed", base + 4 * mib, mib, cupy_arena),
              ("managed", base + 5 * mib, mib, numpy_arena), ("pinned", base + 6 * mib, mib, cupy_arena)]

    def lookup_owner(ptr):
        return next(((kind, b, size, owner) for kind, b, size, owner in blocks if b <= ptr < b + size),
                    (None, 0, 0, -1))

    monkeypatch.setattr(_cupy_hook._core, "lookup_owner", lookup_owner)
    hook = _cupy_hook.CupyHook.__new__(_cupy_hook.CupyHook)
    hook.numpy_arena = numpy_arena
    hook.placement = types.SimpleNamespace(min_bytes=2 * mib, on_host_export=lambda *args: None,
                                           on_result_export=lambda *args: None)
    hook.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(ptr=0),
        runtime=types.SimpleNamespace(streamIsCapturing=lambda stream: False)))
    hook.patches = types.SimpleNamespace(original={"get": lambda g, **kwargs: "CuPy's copy"})

    def shared(offset, nbytes, **kwargs):
        n = nbytes // 8
        g = types.SimpleNamespace(size=n, shape=(n,), strides=(8,), dtype=np.dtype("f8"),
                                  flags=types.SimpleNamespace(c_contiguous=True, f_contiguous=True),
                                  data=types.SimpleNamespace(ptr=base + offset, device_id=0))
        out = hook.get(g, blocking=False, **kwargs)  # no wait: nothing runs here
        return not isinstance(out, str) and out.ctypes.data == g.data.ptr

    assert shared(0, 4 * mib)  # a result the placement follows
    assert not shared(0, 8 << 10)  # a small piece of it
    assert not shared(4 * mib, mib)  # a small result
    assert shared(4 * mib, mib, share_results=True)  # ump.asnumpy
    assert shared(5 * mib, mib)  # NumPy's memory handed to CuPy
    assert shared(6 * mib, mib)  # pinned memory
