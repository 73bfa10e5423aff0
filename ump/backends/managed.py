"""``managed``: cuMemAllocManaged chunks, migrated by the driver on demand.

NumPy-side chunks are advised to live in host memory and be mapped by the
GPU, so a kernel that touches an array once reads it over the link instead
of faulting it across; ump migrates a block once the GPU time spent on it
over the link exceeded what migrating it would cost (docs/backends.md).
"""

from .. import _core
from ._base import Backend


class ManagedBackend(Backend):
    def unavailable(self, caps, device):
        if not caps.gpu:
            return f"no GPU ({caps.reason})"
        if not device.managed_memory:
            return f"{device.name} does not support managed memory"
        if not device.concurrent_managed_access:
            return (f"concurrent managed access is 0 on {device.name}: the CPU could not touch "
                    "managed memory while any kernel runs")
        return None


MANAGED = ManagedBackend(name="managed", provider=_core.PROVIDER_MANAGED, uses_gpu=True,
                         advise_host=True, gpu_resident=True)
