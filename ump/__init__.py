"""ump: unified memory for NumPy and CuPy.

Set ``CUPY_ENABLE_UMP=1``, call :func:`ump.enable` before or after importing
CuPy, and NumPy and CuPy share memory: ``cupy.asarray(numpy_array)`` and
``cupy.asnumpy(cupy_array)`` keep the address and copy nothing (small
arrays that CuPy made in managed memory excepted: those are copied, which
costs less than the page faults a read in place takes).

Importing ump neither imports CuPy nor touches the GPU; its C core loads at
the first use of a name that needs it, so that tools which only import ump
(the pytest plugin of every pytest session in the environment) pay nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

# Public name -> the private module that defines it.
_HOMES = {
    "Statistics": "_core",
    "BackendUnavailableError": "_errors", "OutOfMemoryError": "_errors", "UmpError": "_errors",
    "UmpWarning": "_errors",
    "Capabilities": "_probe", "DeviceInfo": "_probe", "probe": "_probe",
    "Options": "_options",
    "disable": "_enable", "enable": "_enable", "enabled": "_enable", "is_enabled": "_enable",
    "advise": "_api", "asarray": "_api", "asnumpy": "_api", "kind_of": "_api", "migrate": "_api",
    "prefetch": "_api", "statistics": "_api", "synchronize": "_api", "trim": "_api",
    "GrowableBuffer": "_views", "MappedMemory": "_views", "VMMPool": "_vmm", "VMMStatistics": "_vmm",
    "ViewTimes": "_views",
    "ExportHandle": "_share", "import_handle": "_vmm",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads them
    from ._api import advise, asarray, asnumpy, kind_of, migrate, prefetch, statistics, synchronize, trim
    from ._core import Statistics
    from ._enable import disable, enable, enabled, is_enabled
    from ._errors import BackendUnavailableError, OutOfMemoryError, UmpError, UmpWarning
    from ._options import Options
    from ._probe import Capabilities, DeviceInfo, probe
    from ._share import ExportHandle
    from ._views import GrowableBuffer, MappedMemory, ViewTimes
    from ._vmm import VMMPool, VMMStatistics, import_handle


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ump' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def backend():
    """The name of the enabled backend, or None."""
    from ._enable import current

    state = current()
    return state.backend.name if state is not None else None


__all__ = ["__version__", "backend", *sorted(_HOMES, key=lambda n: (not n[0].isupper(), n))]
