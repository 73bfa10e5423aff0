"""The Python layer's view of the C interface matches what the extension
exports from csrc/ump.h: constants, status codes and struct layouts."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from ump import OutOfMemoryError, UmpError, _core, _ucore, _vmm

STRUCTS = [
    (_core._CStats, _ucore.STATS_FIELDS, _ucore.STATS_SIZE, _core.Statistics),
    (_core._CVmmStats, _ucore.VMM_STATS_FIELDS, _ucore.VMM_STATS_SIZE, _vmm.VMMStatistics),
    (_core._CViewTimes, _ucore.VMM_VIEW_TIMES_FIELDS, _ucore.VMM_VIEW_TIMES_SIZE, _vmm.ViewTimes),
]
ERRORS = sorted(name for name in dir(_ucore) if name.startswith("UMP_ERR_"))


@pytest.mark.parametrize("mirror, fields, size, public", STRUCTS, ids=lambda v: getattr(v, "__name__", None))
def test_struct_mirror_has_the_exported_fields_in_order_and_size(mirror, fields, size, public):
    assert fields and len(set(fields)) == len(fields)
    assert [name for name, _ in mirror._fields_] == list(fields)
    assert ctypes.sizeof(mirror) == size == 8 * len(fields)  # uint64_t fields, no padding
    # the public statistics are built field by field from the mirror
    assert [f.name for f in dataclasses.fields(public)] == list(fields)


def test_a_mirror_of_another_size_fails_the_import_naming_the_struct():
    with pytest.raises(ImportError, match="ump_stats_t"):
        _core._u64_struct("_CStats", "ump_stats_t", _ucore.STATS_FIELDS, _ucore.STATS_SIZE + 8)


def test_every_status_code_has_its_name():
    assert ERRORS
    codes = [getattr(_ucore, name) for name in ERRORS]
    assert len(set(codes)) == len(codes)
    assert _ucore.UMP_OK == 0 and all(code < 0 for code in codes)  # CUDA's CUresult values are >= 0
    for name, code in zip(ERRORS, codes):
        assert _core.error_name(code) == name
        assert getattr(_core, name.removeprefix("UMP_")) == code


def test_constants_are_the_extensions():
    assert _core.KIND_IDS == _ucore.KINDS
    assert sorted(_core.KINDS) == sorted(_ucore.KINDS.values())
    assert all(_core.KINDS[kind] == name for name, kind in _ucore.KINDS.items())
    listed = [name.removeprefix("UMP_") for name in dir(_ucore)
              if name.startswith(("UMP_PROVIDER_", "UMP_ARENA_"))]
    assert "PROVIDER_HOST" in listed and "ARENA_CUPY" in listed  # both lists are exported
    for name in (*listed, "ALIGN", "MAX_ARENAS", "MAX_POOLS"):
        assert getattr(_core, name) == getattr(_ucore, "UMP_" + name), name
    assert _vmm.MAX_POOLS == _ucore.UMP_MAX_POOLS
    assert _core.CUDA_ERROR_OUT_OF_MEMORY == _ucore.CUDA_ERROR_OUT_OF_MEMORY == 2  # cuda.h


@pytest.mark.parametrize("status", [_core.ERR_CAP, _core.CUDA_ERROR_OUT_OF_MEMORY])
def test_out_of_memory_statuses_raise_out_of_memory_error(status):
    with pytest.raises(OutOfMemoryError):
        _core.check(status, "allocating")


@pytest.mark.parametrize("status", [_core.ERR_ARG, _core.ERR_HANDLE, 1])
def test_other_statuses_raise_ump_error(status):
    with pytest.raises(UmpError) as info:
        _core.check(status, "allocating")
    assert not isinstance(info.value, OutOfMemoryError)
    assert info.value.cuda_error == _core.error_name(status)


def test_success_raises_nothing():
    _core.check(_core.OK, "allocating")
