"""The pieces of ump/_cupy_compat.py that run without CuPy: DLPack capsule
rewriting and finding a compiled module's private C variable."""

from __future__ import annotations

import ctypes

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
    assert _cupy_compat._elf_symbol(_ucore.__file__, b"no_such_symbol_in_ump") is None


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

        def scalar(self, g):  # a copy of the element, or None: not managed memory
            self.copied.append(g.value)
            return None if g.value < 0 else np.array(g.value + 0.5)

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
