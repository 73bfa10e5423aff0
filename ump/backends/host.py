"""``host``: plain host memory in a process with no GPU.

Nothing is shared with a GPU; NumPy still allocates through ump's arena, so
the allocator, the registry and the NumPy hook run everywhere (CI included).
"""

from .. import _core
from ._base import Backend


class HostBackend(Backend):
    def unavailable(self, caps, device):
        if caps.gpu:
            return "this machine has a GPU: pick a unified-memory backend instead"
        return None


HOST = HostBackend(name="host", provider=_core.PROVIDER_HOST, uses_gpu=False)
