"""What this machine can do: GPUs, their memory-model attributes, versions.

The probe reads the devices through the C core (csrc/device.c) with driver
calls that need no CUDA context (cuInit, cuDeviceGetAttribute,
cuMemGetAllocationGranularity), so probing never creates one; importing ump
does not even probe.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import platform

from ._errors import UmpError
from ._options import check_device_index
from ._version import pip_install

__all__ = ["Capabilities", "DeviceInfo", "probe", "host_available_bytes"]


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """Memory-model facts of one CUDA device.

    Attributes
    ----------
    pageable_memory_access : bool
        The GPU can access ``malloc``'d memory (SAM: HMM or ATS).
    uses_host_page_tables : bool
        SAM goes through the host's page tables (ATS, e.g. Grace Hopper);
        false with SAM means HMM.
    concurrent_managed_access : bool
        CPU and GPU may touch managed memory at the same time.
    host_pointer_for_registered_mem : bool
        Registered host memory has the same address on the device.
    vmm_supported : bool
        cuMemCreate / cuMemMap are available.
    vmm_granularity, vmm_recommended_granularity : int
        Bytes; 0 without VMM.
    """

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    managed_memory: bool
    pageable_memory_access: bool
    uses_host_page_tables: bool
    concurrent_managed_access: bool
    host_pointer_for_registered_mem: bool
    vmm_supported: bool
    vmm_granularity: int
    vmm_recommended_granularity: int

    @property
    def addressing_mode(self) -> str | None:
        """``"ATS"``, ``"HMM"`` or None (no system-allocated memory)."""
        if not self.pageable_memory_access:
            return None
        return "ATS" if self.uses_host_page_tables else "HMM"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """The result of :func:`probe`. ``gpu`` is False with ``reason`` set when
    no usable GPU was found; the version attributes are None when not
    installed, and are read when first asked for (reading them costs
    ``enable()`` time a program started by ``python -m ump run`` would pay)."""

    gpu: bool
    reason: str | None
    devices: tuple[DeviceInfo, ...]
    driver_version: int | None
    python_version: str

    @functools.cached_property
    def runtime_version(self) -> int | None:
        return _runtime_version() if self.gpu else None

    @functools.cached_property
    def numpy_version(self) -> str | None:
        return _dist_version("numpy")

    @functools.cached_property
    def cupy_version(self) -> str | None:
        return _cupy_version()

    @functools.cached_property
    def numpy_allocator_version(self) -> str | None:
        return _dist_version("numpy_allocator", "numpy-allocator")

    @functools.cached_property
    def cuda_bindings_version(self) -> str | None:
        return _dist_version("cuda-bindings", "cuda_bindings")

    def as_dict(self) -> dict:
        """Every field and version, as plain data (JSON)."""
        out = dataclasses.asdict(self)
        out.update((name, getattr(self, name)) for name in VERSIONS)
        return out


#: The attributes of :class:`Capabilities` read when first asked for.
VERSIONS = ("runtime_version", "numpy_version", "cupy_version", "numpy_allocator_version",
            "cuda_bindings_version")


def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


#: The distributions CuPy ships as, tried before a scan of every installed
#: distribution (which reads each one's metadata: a tenth of a second in a
#: large environment, paid by every program ``python -m ump run`` starts).
CUPY_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")


def _cupy_version() -> str | None:
    # CuPy ships as cupy-cudaXXx wheels (or cupy from source): look the
    # distribution up rather than import CuPy, which probing must not do.
    if importlib.util.find_spec("cupy") is None:
        return None
    version = _dist_version(*CUPY_DISTRIBUTIONS)
    if version is not None:
        return version
    from importlib import metadata

    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda") or name.startswith("cupy-rocm"):
            return dist.version
    return None


# cuda-bindings is an extra, not a dependency: its major version must match
# the CUDA driver's, which pip cannot see.
CUDA_BINDINGS_MISSING = (f"cuda-bindings is not installed: {pip_install('cuda12', 'cuda13')}, "
                         "matching the CUDA major version of the driver")


def _bindings_missing() -> str | None:
    """Why ump does not use the GPU for want of cuda-bindings, or None. A GPU
    is one ump uses where cuda-bindings is installed (the cuda12/cuda13
    extras), since sharing memory between processes needs it. Found, not
    imported: the probe reads the devices through the C core, and importing
    cuda-bindings' driver module would cost a program started by
    ``python -m ump run`` tens of milliseconds."""
    try:
        found = importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):  # None in sys.modules, or a broken parent package
        found = False
    return None if found else CUDA_BINDINGS_MISSING


def _device(index: int, name: str, f: dict) -> DeviceInfo:
    return DeviceInfo(
        index=index,
        name=name,
        compute_capability=(f["compute_capability_major"], f["compute_capability_minor"]),
        total_memory=f["total_memory"],
        managed_memory=bool(f["managed_memory"]),
        pageable_memory_access=bool(f["pageable_memory_access"]),
        uses_host_page_tables=bool(f["uses_host_page_tables"]),
        concurrent_managed_access=bool(f["concurrent_managed_access"]),
        host_pointer_for_registered_mem=bool(f["host_pointer_for_registered_mem"]),
        vmm_supported=bool(f["vmm_supported"]),
        vmm_granularity=f["vmm_granularity"],
        vmm_recommended_granularity=f["vmm_recommended_granularity"],
    )


def _runtime_version() -> int | None:
    try:
        from cuda.bindings import runtime

        err, version = runtime.cudaRuntimeGetVersion()
        return int(version) if err == runtime.cudaError_t.cudaSuccess else None
    except Exception:  # no libcudart found: the runtime is optional to ump
        return None


@functools.lru_cache(maxsize=1)
def _probe_gpu() -> tuple[bool, str | None, tuple[DeviceInfo, ...], int | None]:
    missing = _bindings_missing()
    if missing is not None:
        return False, missing, (), None
    from . import _driver

    try:
        _driver.load()
    except UmpError:
        return False, "no CUDA driver: libcuda.so.1 could not be opened", (), None
    try:
        version, count = _driver.device_count()
    except UmpError as err:
        if err.cuda_error == "UMP_ERR_FORKED":
            return False, f"a child process made by fork() cannot use CUDA ({err})", (), None
        return False, f"the CUDA driver did not initialise: {err}", (), None
    try:
        devices = tuple(_device(i, *_driver.device(i)) for i in range(count))
    except UmpError as err:
        return False, f"probing the GPU failed: {err}", (), None
    if not devices:
        return False, "the CUDA driver reports no device", (), version
    return True, None, devices, version


def host_available_bytes() -> int:
    """Bytes of memory the host has available now (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_info(caps: Capabilities, device) -> DeviceInfo:
    """The :class:`DeviceInfo` of ``device``; ValueError if it is not a
    device of this machine."""
    check_device_index(device)
    if device >= len(caps.devices):
        raise ValueError(f"device {device} does not exist: this machine has "
                         f"{len(caps.devices)} CUDA device(s)")
    return caps.devices[device]


def probe() -> Capabilities:
    """Probe the machine once (cached) and report what ump can use.

    Never raises: without a GPU or driver, ``gpu`` is False and ``reason``
    says why. Creates no CUDA context.

    Returns
    -------
    Capabilities
    """
    gpu, reason, devices, driver_version = _probe_gpu()
    return Capabilities(gpu=gpu, reason=reason, devices=devices, driver_version=driver_version,
                        python_version=platform.python_version())
