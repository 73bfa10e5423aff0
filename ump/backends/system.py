"""``system``: system-allocated memory on SAM machines (HMM or ATS).

The GPU reaches any host page, so chunks are plain anonymous memory. On a
machine without SAM a GPU access to such memory faults, so the backend
refuses there; its code path is the ``pinned`` backend's minus the
registration step (csrc/provider.c), which is how it runs on GPUs without SAM.
"""

from .. import _core
from ._base import Backend


class SystemBackend(Backend):
    def unavailable(self, caps, device):
        if not caps.gpu:
            return f"no GPU ({caps.reason})"
        if not device.pageable_memory_access:
            return ("pageable memory access is 0 on "
                    f"{device.name}: no HMM/ATS, GPU access to malloc'd memory would fault")
        return None


SYSTEM = SystemBackend(name="system", provider=_core.PROVIDER_HOST, uses_gpu=True, spills_to_device=True)
