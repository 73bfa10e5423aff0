"""``device``: CuPy arrays in a VMM device pool, NumPy arrays in pinned memory.

Not unified: the GPU works on device memory at full speed and transfers are
copies. NumPy's arrays live in pinned host memory, so a copy either way is one
DMA straight from or into the NumPy array (no pageable staging). Chosen only
by name; ``auto`` picks a unified backend.
"""

from .. import _core
from ._base import Backend


class DeviceBackend(Backend):
    def unavailable(self, caps, device):
        if not caps.gpu:
            return f"no GPU ({caps.reason})"
        if not device.vmm_supported:
            return f"{device.name} does not support virtual memory management (cuMemCreate/cuMemMap)"
        return None


DEVICE = DeviceBackend(name="device", provider=_core.PROVIDER_PINNED, uses_gpu=True,
                       numpy_kind="pinned", gpu_resident=True, vmm_pool=True)
