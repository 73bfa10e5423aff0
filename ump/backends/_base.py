"""What every backend is: :class:`Backend`, and the budgets its defaults
come from. The backends' modules build on it; ``ump.backends`` picks one."""

from __future__ import annotations

import dataclasses

from .. import _probe
from .._probe import Capabilities, DeviceInfo

__all__ = ["Backend", "HOST_SHARE", "default_headroom"]


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
        host = int(_probe.host_available_bytes() * HOST_SHARE)
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
