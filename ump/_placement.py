"""Placement of managed NumPy blocks: host-resident, or migrated to the GPU.

A block starts host-resident: kernels reach it over the link, which is
fastest for work that touches it once. ump learns from what it sees at the
two points it takes part in, hand-offs (NumPy to CuPy) and host exports
(CuPy to the host, which wait for the GPU anyway), per block, so a loop that
reallocates the same array learns too:

- **Round trips** (hand-off, kernels, an export the host reads whole, the
  next hand-off): at the export ump reads the GPU time the block's work cost
  since the hand-off (on the GPU's clock, but no more than the host waited
  at the export: events also count the GPU idling while the host compiles
  or dispatches, and work that ran while the host was busy cost nothing).
  Once that exceeds migrating the block there and back, the block is
  *heavy*: later hand-offs migrate it and exports bring it back (a
  ski-rental rule).
- **Peek loops** (the block stays with CuPy; exports follow one another with
  no hand-off between, the host reading a little each time): from the second
  export on, when the GPU time between two exports exceeds migrating the
  block one way, ump migrates it at that export and leaves it on the GPU;
  the host faults in only the pages it reads. If the GPU time between later
  exports comes to half the host-resident time or more (the host read much
  of the block, so the kernels fault it back), ump brings the block back and
  keeps it host-resident until its next hand-off; otherwise the block is
  known to be *peeked*, and later hand-offs migrate it at once.

A migration that would not fit in the device's free memory less the
headroom is not made.
"""

from __future__ import annotations

import dataclasses

from . import _core
from ._cupy_compat import capturing

__all__ = ["Placement", "MIGRATION_SECONDS_PER_BYTE", "ONE_WAY_SECONDS_PER_BYTE"]

#: What migrating managed memory to the GPU and back costs, per byte: 21 ms
#: there and 109 ms back per GiB, measured in the round-trip workflow on an
#: H200 over PCIe (docs/backends.md).
MIGRATION_SECONDS_PER_BYTE = 0.130 / 2**30
#: What migrating it to the GPU costs, per byte: a prefetch alone, 22 ms per
#: GiB on the same H200 (docs/backends.md, "How fast managed memory moves").
ONE_WAY_SECONDS_PER_BYTE = 0.022 / 2**30

#: Blocks whose state is kept; past it the table starts over.
MAX_BLOCKS = 4096


@dataclasses.dataclass
class BlockState:
    on_gpu: int | None = None   # the device ump migrated the block to
    heavy: bool = False         # round trips: GPU time on it beat a migration there and back
    peeked: bool = False        # peek loops: leaving it on the GPU paid
    start: object = None        # event recorded at the hand-off being measured
    start_device: int = -1      # the device that event belongs to
    exports: int = 0            # host exports since the last hand-off
    host_seconds: float | None = None  # GPU time of the last interval spent host-resident
    moved: bool = False         # migrated since the last export: the next interval holds its cost
    stay_host: bool = False     # a trial on the GPU lost: host-resident until the next hand-off


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

    def _to_gpu(self, state: BlockState, base: int, size: int, stream) -> None:
        """Prefetch the block to the current device; one that would not fit
        stays where it is, counted as host-resident."""
        if not self._fits(size):
            state.on_gpu = None
            return
        device = self.cupy.cuda.runtime.getDevice()
        _core.prefetch(base, size, device, stream.ptr)
        state.on_gpu = device
        state.moved = True

    def _to_host(self, state: BlockState, base: int, size: int, stream, wait: bool) -> None:
        _core.prefetch(base, size, -1, stream.ptr)
        if wait:
            stream.synchronize()  # else the caller waits for the stream, as CuPy's contract says
        state.on_gpu = None

    def on_handoff(self, kind: str, base: int, size: int) -> None:
        """A NumPy array's block is handed to CuPy."""
        if kind != "managed" or size < self.min_bytes or self.mode == "host":
            return
        if capturing(self.cupy):
            return  # nothing runs until the graph is launched: no event to time, no move
        state = self.blocks.get((base, size))
        if state is None:
            if len(self.blocks) >= MAX_BLOCKS:
                self.blocks.clear()
            state = self.blocks[(base, size)] = BlockState()
        if state.peeked and state.exports < 2:
            # The loop since the last hand-off was a round trip, not a peek
            # loop: the host may have read the block whole (faulting it
            # back, one interval of faults); measure it as a round trip.
            state.peeked = False
        state.exports, state.stay_host, state.moved = 0, False, False
        cuda = self.cupy.cuda
        if self.mode == "migrate" or state.heavy or state.peeked:
            # Prefetched even if ump left it on the GPU: the host may have
            # written it since (or freed and allocated it again), which
            # brings pages back.
            self._to_gpu(state, base, size, cuda.get_current_stream())
        elif state.start is None:
            state.start = cuda.Event()
            state.start.record()
            state.start_device = cuda.runtime.getDevice()

    def on_host_export(self, kind: str, base: int, size: int, waited: float | None = None) -> None:
        """A block goes back to the host (``waited``: seconds the host just
        waited for the GPU, None if it did not wait): learn from the GPU time
        it took, and move it if that pays."""
        if kind != "managed":
            return
        state = self.blocks.get((base, size))
        if state is None:
            return
        stream = self.cupy.cuda.get_current_stream()
        state.exports += 1
        seconds = self._gpu_seconds(state, stream, waited)
        if state.on_gpu is None:
            self._learn_host_resident(state, base, size, stream, seconds)
        elif self.mode == "migrate" or (state.exports == 1 and not state.peeked):
            # Right after a hand-off the host may read all of it (round trips).
            self._to_host(state, base, size, stream, waited is not None)
        else:
            self._learn_gpu_resident(state, base, size, stream, seconds, waited is not None)

    def _gpu_seconds(self, state: BlockState, stream, waited: float | None) -> float | None:
        """The GPU time the block's work cost since the hand-off (its event)
        or the last export (the host's wait alone)."""
        if state.start is None:
            return waited
        cuda = self.cupy.cuda
        start, state.start = state.start, None
        # A measurement needs the host's wait (a non-blocking get() has
        # none) and both events on one device.
        if waited is None or state.start_device != cuda.runtime.getDevice():
            return None
        end = cuda.Event()
        end.record(stream)
        end.synchronize()
        return min(cuda.get_elapsed_time(start, end) / 1e3, waited)

    def _learn_host_resident(self, state: BlockState, base: int, size: int, stream,
                             seconds: float | None) -> None:
        if seconds is None or self.mode != "auto":
            return
        if state.exports == 1 and seconds > size * MIGRATION_SECONDS_PER_BYTE:
            state.heavy = True  # measured from the hand-off: a round trip's work
        state.host_seconds = seconds
        if (state.exports >= 2 and not state.stay_host
                and seconds > size * ONE_WAY_SECONDS_PER_BYTE):
            # A peek loop whose kernels would have paid for the move: the
            # host reads the view after this returns and faults in what it
            # touches; the rest stays for the next kernels.
            self._to_gpu(state, base, size, stream)

    def _learn_gpu_resident(self, state: BlockState, base: int, size: int, stream,
                            seconds: float | None, wait: bool) -> None:
        if state.moved:
            state.moved = False  # that interval paid for the move: no verdict
            return
        if seconds is None:
            return  # nothing measured (a non-blocking get)
        if state.host_seconds is not None and 2 * seconds >= state.host_seconds:
            # The host read enough of the block that the kernels fault it
            # back: host-resident costs less in this loop.
            state.peeked = False
            state.stay_host = True
            self._to_host(state, base, size, stream, wait)
        else:
            state.peeked = True
