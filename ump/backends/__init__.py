"""The backends ump can enable, and how ``backend="auto"`` picks one.

Each backend is a small description: which kind of memory its arenas hold,
where their chunks come from, and what the machine must offer. The arena,
the registry and the framework hooks are the same for all of them.
"""

from __future__ import annotations

import dataclasses
import os

from .._errors import BackendUnavailableError
from .._options import BACKENDS, check_device_index
from .._probe import Capabilities, DeviceInfo, device_info

__all__ = ["Backend", "AUTO_ORDER", "HOST_SHARE", "default_headroom", "host_available_bytes", "get", "select", "names"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One kind of unified memory.

    Attributes
    ----------
    name : str
        What users pass to ``ump.enable(backend=...)``; also the kind
        ``ump.kind_of`` reports for its blocks.
    provider : int
        The C core's chunk provider (``ump._core.PROVIDER_*``).
    uses_gpu : bool
        Needs a CUDA device; enabling it registers CuPy hooks.
    advise_host : bool
        NumPy-side chunks are advised to stay in host memory, mapped by the
        GPU (managed memory only).
    numpy_kind : str, optional
        The kind of NumPy's arena when it differs from ``name`` (the
        ``device`` backend keeps NumPy arrays in pinned memory).
    gpu_resident : bool
        CuPy's side of the memory is held by the GPU (managed memory
        migrates there; VMM device memory), so its budget is the device's
        free memory less the headroom, not the host's memory.
    spills_to_device : bool
        CuPy's side is host memory; past the budget CuPy takes plain device
        memory, as stock CuPy does, instead of failing.
    vmm_pool : bool
        CuPy's side is a VMM device pool (:class:`ump.VMMPool`), not an
        arena; NumPy <-> CuPy are copies.
    """

    name: str
    provider: int
    uses_gpu: bool
    advise_host: bool = False
    numpy_kind: str | None = None
    gpu_resident: bool = False
    spills_to_device: bool = False
    vmm_pool: bool = False

    @property
    def numpy_arena_kind(self) -> str:
        return self.numpy_kind or self.name

    def unavailable(self, caps: Capabilities, device: DeviceInfo | None) -> str | None:
        """Why this backend cannot run here, or None if it can."""
        raise NotImplementedError

    def default_cap(self, free_device: int | None, headroom: int) -> int:
        """Bytes NumPy's side (with CuPy's, where they share the kind) may
        hold when the user sets no cap.

        Managed or pinned memory beyond what the GPU has free can hang a
        shared GPU, so no unified backend takes more than the device's free
        memory less the headroom; host memory is further bounded by
        :data:`HOST_SHARE` of the host's available memory.
        """
        host = int(host_available_bytes() * HOST_SHARE)
        if free_device is None:
            return host
        gpu = max(free_device - headroom, 0)
        return gpu if self.gpu_resident and self.numpy_kind is None else min(gpu, host)

    def cupy_cap(self, free_device: int | None, headroom: int) -> int:
        """The budget of CuPy's side (its arena, or the VMM pool's limit)."""
        if free_device is not None and self.gpu_resident:
            return max(free_device - headroom, 0)
        return self.default_cap(free_device, headroom)


#: The share of the host's available memory that host-resident unified
#: memory may take by default.
HOST_SHARE = 0.75


def default_headroom(total_device: int) -> int:
    """Device memory ump leaves to CUDA libraries, kernels' scratch space and
    other processes: 512 MiB or 1/64 of the device, whichever is larger
    (2.2 GiB on a 141 GiB H200)."""
    return max(512 << 20, total_device // 64)


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


from .host import HOST  # noqa: E402
from .managed import MANAGED  # noqa: E402
from .pinned import PINNED  # noqa: E402
from .system import SYSTEM  # noqa: E402
from .device import DEVICE  # noqa: E402

# One module per backend, named after it; the option table holds the names.
_ALL = {name: globals()[name.upper()] for name in BACKENDS}
#: The order ``backend="auto"`` tries on a machine with a GPU.
AUTO_ORDER = ("system", "managed", "pinned")


def names() -> tuple[str, ...]:
    return tuple(_ALL)


def get(name: str) -> Backend:
    try:
        return _ALL[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown backend {name!r}; choose one of 'auto', "
            + ", ".join(repr(n) for n in _ALL)
        ) from None


def select(name: str, caps: Capabilities, device: int = 0) -> Backend:
    """The backend to enable for ``name`` (``"auto"`` or a backend's name).

    Raises
    ------
    ValueError
        Unknown name or device index.
    BackendUnavailableError
        The machine cannot run the backend; the message says why.
    """
    check_device_index(device)
    info = device_info(caps, device) if caps.gpu else None
    if name == "auto":
        if not caps.gpu:
            return HOST
        reasons = []
        for candidate in AUTO_ORDER:
            why = _ALL[candidate].unavailable(caps, info)
            if why is None:
                return _ALL[candidate]
            reasons.append(f"{candidate}: {why}")
        raise BackendUnavailableError("no unified-memory backend can run here; " + "; ".join(reasons))
    backend = get(name)
    why = backend.unavailable(caps, info)
    if why is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run here: {why}")
    return backend
