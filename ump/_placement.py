"""Placement of managed NumPy blocks: host-resident, or migrated to the GPU.

A block starts host-resident: kernels reach it over the link, which is
fastest for work that touches it once. At the next host export ump measures
the GPU time the block's work cost the program: the time between a hand-off
and the export on the GPU's clock, but no more than the host waited for the
GPU at the export (events also count the GPU idling while the host compiles
or dispatches, and work that ran while the host was busy cost nothing). Once
that exceeds what migrating the block there and back would have cost, the
block is *heavy* and later hand-offs migrate it (a ski-rental rule). The state is per block, not per array, so a
loop that reallocates the same array learns too. A migration that would not
fit in the device's free memory less the headroom is not made.
"""

from __future__ import annotations

import dataclasses

from . import _core

__all__ = ["Placement", "MIGRATION_SECONDS_PER_BYTE"]

#: What migrating managed memory to the GPU and back costs, per byte: 21 ms
#: and 109 ms per GiB measured on an H200 over PCIe (docs/backends.md).
MIGRATION_SECONDS_PER_BYTE = 0.130 / 2**30

#: Blocks whose state is kept; past it the table starts over.
MAX_BLOCKS = 4096


@dataclasses.dataclass
class BlockState:
    on_gpu: int | None = None   # the device ump migrated the block to
    heavy: bool = False         # GPU time on it beat a migration
    start: object = None        # event recorded at the hand-off being measured
    start_device: int = -1      # the device that event belongs to


class Placement:
    """The placement policy of one enabled managed backend."""

    def __init__(self, cupy, options, headroom: int):
        self.cupy = cupy
        self.mode = options.placement
        self.min_bytes = options.prefetch_min
        self.headroom = headroom
        self.blocks: dict[tuple[int, int], BlockState] = {}

    def state(self, base: int, size: int) -> BlockState | None:
        return self.blocks.get((base, size))

    def _fits(self, size: int) -> bool:
        free, _total = self.cupy.cuda.runtime.memGetInfo()
        return size + self.headroom <= free

    def on_handoff(self, kind: str, base: int, size: int) -> None:
        """A NumPy array's block is handed to CuPy."""
        if kind != "managed" or size < self.min_bytes or self.mode == "host":
            return
        state = self.blocks.get((base, size))
        if state is None:
            if len(self.blocks) >= MAX_BLOCKS:
                self.blocks.clear()
            state = self.blocks[(base, size)] = BlockState()
        cuda = self.cupy.cuda
        if self.mode == "migrate" or state.heavy:
            device = cuda.runtime.getDevice()
            if state.on_gpu != device and self._fits(size):
                _core.prefetch(base, size, device, cuda.get_current_stream().ptr)
                state.on_gpu = device
        elif state.start is None:
            state.start = cuda.Event()
            state.start.record()
            state.start_device = cuda.runtime.getDevice()

    def on_host_export(self, kind: str, base: int, size: int, waited: float | None = None) -> None:
        """A block goes back to the host: learn from the GPU time it took
        (``waited``: seconds the host just waited for the GPU, if it did),
        and bring it back if ump migrated it."""
        if kind != "managed":
            return
        state = self.blocks.get((base, size))
        if state is None:
            return
        cuda = self.cupy.cuda
        stream = cuda.get_current_stream()
        if state.start is not None:
            start, state.start = state.start, None
            # A measurement needs the host's wait (a non-blocking get() has
            # none) and both events on one device.
            if waited is not None and state.start_device == cuda.runtime.getDevice():
                end = cuda.Event()
                end.record(stream)
                end.synchronize()
                gpu_seconds = min(cuda.get_elapsed_time(start, end) / 1e3, waited)
                if gpu_seconds > size * MIGRATION_SECONDS_PER_BYTE:
                    state.heavy = True
        if state.on_gpu is not None:
            _core.prefetch(base, size, -1, stream.ptr)
            if waited is not None:
                stream.synchronize()  # else the caller waits for the stream, as CuPy's contract says
            state.on_gpu = None
