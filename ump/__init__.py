"""ump: unified memory for NumPy and CuPy.

Set ``CUPY_ENABLE_UMP=1``, call :func:`ump.enable` before importing CuPy,
and NumPy and CuPy share memory: ``cupy.asarray(numpy_array)`` and
``cupy.asnumpy(cupy_array)`` keep the address and copy nothing.

Importing ump neither imports CuPy nor touches the GPU.
"""

from ._version import __version__
from ._core import Statistics
from ._errors import BackendUnavailableError, OutOfMemoryError, UmpError, UmpWarning
from ._probe import Capabilities, DeviceInfo, probe
from ._enable import Options, disable, enable, enabled, is_enabled
from ._api import advise, asarray, asnumpy, kind_of, migrate, prefetch, statistics, synchronize, trim
from ._vmm import GrowableBuffer, MappedMemory, VMMPool, VMMStatistics, ViewTimes
from ._share import ExportHandle, import_handle


def backend():
    """The name of the enabled backend, or None."""
    from ._enable import current

    state = current()
    return state.backend.name if state is not None else None


__all__ = [
    "__version__",
    "BackendUnavailableError",
    "Capabilities",
    "DeviceInfo",
    "ExportHandle",
    "GrowableBuffer",
    "MappedMemory",
    "Options",
    "OutOfMemoryError",
    "Statistics",
    "UmpError",
    "UmpWarning",
    "VMMPool",
    "VMMStatistics",
    "ViewTimes",
    "advise",
    "asarray",
    "asnumpy",
    "backend",
    "disable",
    "enable",
    "enabled",
    "import_handle",
    "is_enabled",
    "kind_of",
    "migrate",
    "prefetch",
    "probe",
    "statistics",
    "synchronize",
    "trim",
]
