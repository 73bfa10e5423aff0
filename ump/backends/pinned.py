"""``pinned``: host memory registered with the GPU (cuMemHostRegister).

The GPU reads and writes it over the link without migration. Chunks are the
``system`` backend's anonymous memory plus registration, and with
``canUseHostPointerForRegisteredMem`` the device address is the host address.
"""

from .. import _core
from ._base import Backend


class PinnedBackend(Backend):
    def unavailable(self, caps, device):
        if not caps.gpu:
            return f"no GPU ({caps.reason})"
        if not device.host_pointer_for_registered_mem:
            return (f"{device.name} cannot use host pointers for registered memory: "
                    "device and host addresses would differ")
        return None


PINNED = PinnedBackend(name="pinned", provider=_core.PROVIDER_PINNED, uses_gpu=True, spills_to_device=True)
