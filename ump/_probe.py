"""What this machine can do: GPUs, their memory-model attributes, versions.

The probe uses only driver calls that need no CUDA context (cuInit,
cuDeviceGetAttribute, cuMemGetAllocationGranularity), so probing never
creates one; importing ump does not even probe.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import platform

from ._errors import UmpError
from ._options import check_device_index
from ._version import pip_install

__all__ = ["Capabilities", "DeviceInfo", "probe"]


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


class _DriverError(UmpError):
    """A CUDA driver call failed; ``cuda_error`` names CUDA's error. An
    :class:`UmpError`, so a failure no caller expected still reaches users
    as one of ump's errors."""


def _call(fn, *args):
    from cuda.bindings import driver

    err, *values = fn(*args)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise _DriverError(f"{fn.__name__} failed", name.decode() if name else str(err))
    return values[0] if len(values) == 1 else values


def _probe_device(driver, index: int) -> DeviceInfo:
    dev = _call(driver.cuDeviceGet, index)
    A = driver.CUdevice_attribute

    def attr(name: str) -> int:
        return int(_call(driver.cuDeviceGetAttribute, getattr(A, name), dev))

    vmm = bool(attr("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))
    gran = rec = 0
    if vmm:
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        G = driver.CUmemAllocationGranularity_flags
        gran = int(_call(driver.cuMemGetAllocationGranularity, prop,
                         G.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        rec = int(_call(driver.cuMemGetAllocationGranularity, prop,
                        G.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    name = _call(driver.cuDeviceGetName, 256, dev)
    return DeviceInfo(
        index=index,
        name=name.split(b"\0", 1)[0].decode(),
        compute_capability=(attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
                            attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")),
        total_memory=int(_call(driver.cuDeviceTotalMem, dev)),
        managed_memory=bool(attr("CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY")),
        pageable_memory_access=bool(attr("CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS")),
        uses_host_page_tables=bool(
            attr("CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES")),
        concurrent_managed_access=bool(attr("CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS")),
        host_pointer_for_registered_mem=bool(
            attr("CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM")),
        vmm_supported=vmm,
        vmm_granularity=gran,
        vmm_recommended_granularity=rec,
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
    try:
        from cuda.bindings import driver
    except ImportError as err:
        if isinstance(err, ModuleNotFoundError) and err.name in ("cuda", "cuda.bindings"):
            return False, CUDA_BINDINGS_MISSING, (), None
        return False, f"cuda-bindings is installed but not importable: {err}", (), None
    try:
        _call(driver.cuInit, 0)
    except _DriverError as err:
        return False, f"the CUDA driver did not initialise: {err}", (), None
    except Exception as err:  # the driver library itself is missing
        return False, f"no CUDA driver: {err}", (), None
    try:
        version = int(_call(driver.cuDriverGetVersion))
        count = int(_call(driver.cuDeviceGetCount))
        devices = tuple(_probe_device(driver, i) for i in range(count))
    except _DriverError as err:
        return False, f"probing the GPU failed: {err}", (), None
    if not devices:
        return False, "the CUDA driver reports no device", (), version
    return True, None, devices, version


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
