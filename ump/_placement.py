"""Placement of managed NumPy blocks: host-resident, or migrated to the GPU.

A block starts host-resident: kernels reach it over the link, which is
fastest for work that touches it once. ump learns from what it sees at the
two points it takes part in, hand-offs (NumPy to CuPy) and host exports
(CuPy to the host, which wait for the GPU anyway), per block, so a loop that
reallocates the same array learns too:

- **Round trips** (hand-off, kernels, an export the host reads whole, the
  next hand-off): at the export ump reads the GPU time the block's work cost
  since the hand-off (on the GPU's clock, but no more than the host waited
  since the hand-off, at the export and before it: events also count the
  GPU idling while the host compiles or dispatches, and work that ran while
  the host was busy cost nothing).
  Once that exceeds migrating the block there and back, the block is
  *heavy*: later hand-offs migrate it and exports bring it back (a
  ski-rental rule). A heavy block's round trip is timed too, from the end
  of the migration: when its kernels took so little that even over the
  link, at the slowdown of a memory-bound kernel, they would have cost
  under half a migration there and back, the work has shrunk and the block
  is host-resident again until it earns the migration anew. A block with
  no verdict of its own is heavy at its hand-off when the last verdict on
  a block of its size was, until it has one of its own: a loop that makes
  a new array before it drops the last one (``a = np.empty(n); ...``)
  hands over two blocks in turn, and each would otherwise pay one round
  trip over the link to learn what the other showed.
- **Work between other arrays' reads** (the block is handed over, then
  kernels read it again and again while the host reads only other arrays,
  such as a solver's scalar residual): at every wait for the GPU that ump
  makes (exports of any array, and scalar reads, which copy) or that the
  program asks CuPy for (a stream's, an event's or the device's
  ``synchronize``: ``CupyHook.program_wait``), the host's waits
  on the block's device since its last hand-off are a lower bound of the
  GPU time spent meanwhile, of which over the link about 95 % would be
  lost if the kernels read this block. Once that loss exceeds what the
  migration can cost, ump migrates the block, while its CuPy view is
  alive: one way when nothing but CuPy's view holds the NumPy array (the
  host can then reach it only through an export, which ump sees and brings
  back), one way plus the host's faults bringing it back otherwise (the
  host may read it in place). The move is judged at the block's export or
  next hand-off: if the work since the hand-off paid for a move there and
  back, the block is *heavy* (later hand-offs move it at once); if not, the
  count starts over, and an upload (below) is not made again for that
  block. Waits several threads make at once count once.
- **Uploads** (``x = cupy.asarray(x)``, ``cupy.asarray(numpy.load(f))``:
  nothing but CuPy's view holds the NumPy array any more): the program
  gave the data to the GPU, and the host can have it back only through an
  export, or through NumPy's reuse of the memory once CuPy's view dies. ump
  asks at the first CuPy allocations after the hand-off (the next kernel's
  output, typically) and migrates such a block at once, one way, for a
  fifth of what stock CuPy's copy at the hand-off costs; otherwise the
  first kernels before any wait would all read it over the link.
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

**Results the host reads back** (CuPy's own blocks, not handed over by
NumPy): CuPy's blocks live on the GPU. When the host's wait at an export of
an array covering most of its block exceeds moving the block one way, and
the block was exported before, the GPU paid for more than its own work:
typically the host read the block whole and the GPU's next write faulted it
back. ump then maps the block for the GPU in host memory (advice: preferred
location host, accessed by the device), as NumPy's blocks are: the GPU
writes it over the link and the host reads it in place. Every later export
checks: two waits not under half of the one that started this, with no
faster life between them, send the block back to the GPU for good. While a
block is host-mapped, ump watches CuPy's allocations: CuPy's pool handing
its memory to another array, or the same array living twice as long as the
loop's lives did, puts it back on the GPU (GPU work on host pages crosses
the link on every pass), and so does the block's return to the arena. A
block exported for the first time is prefetched back to its GPU at CuPy's
next allocation, unless that allocation reuses it: the host has read it by
then, typically, and the kernels that come next would fault back every page
it read (a prefetch before the host's read moves nothing, the pages being on
the GPU still).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import weakref

import numpy

from . import _core
from ._cupy_compat import capturing
from ._errors import UmpError

__all__ = ["Placement", "MIGRATION_SECONDS_PER_BYTE", "ONE_WAY_SECONDS_PER_BYTE",
           "HOST_FAULTS_SECONDS_PER_BYTE", "LINK_OVER_HBM"]

#: What migrating managed memory to the GPU and back costs, per byte: 21 ms
#: there and 109 ms back per GiB, measured in the round-trip workflow on an
#: H200 over PCIe (docs/backends.md).
MIGRATION_SECONDS_PER_BYTE = 0.130 / 2**30
#: What migrating it to the GPU costs, per byte: a prefetch alone, 22 ms per
#: GiB on the same H200 (docs/backends.md, "How fast managed memory moves").
ONE_WAY_SECONDS_PER_BYTE = 0.022 / 2**30

#: What the host's page faults cost to bring a migrated block back, per
#: byte: reading 1 GiB of managed memory the GPU wrote takes 200 ms on the
#: same H200 (docs/backends.md). A block the host still holds may come back
#: this way, unseen by ump.
HOST_FAULTS_SECONDS_PER_BYTE = 0.200 / 2**30

#: How many times longer a memory-bound kernel takes over the link than in
#: HBM: 25.5 against 1.3 ms per GiB on the same H200 (docs/backends.md). A
#: kernel bound by compute loses less, so scaling GPU time by this ratio
#: overstates what the host-resident block would cost.
LINK_OVER_HBM = 20

#: Waits not under half of the trial's, with no faster life between them,
#: that send a host-mapped result back to the GPU for good.
SLOW_LIVES = 2

#: Blocks whose state is kept; past it the table starts over.
MAX_BLOCKS = 4096
#: Blocks handed over and followed across other arrays' reads; past it the
#: oldest is dropped (it stays where it is).
MAX_PENDING = 256
#: CuPy allocations after a hand-off at which ump asks whether the program
#: still holds the NumPy array (``x = cupy.asarray(x)`` lets go of it at
#: once); past them only waits decide.
HOLD_CHECKS = 4


def _log(message: str, *args) -> None:
    """Log one move the policy makes, at DEBUG level, to the
    ``ump.placement`` logger. Moves are rare, and importing :mod:`logging`
    here instead of at start-up keeps it out of every program that
    ``python -m ump run`` starts (CuPy does not import it)."""
    import logging

    logging.getLogger("ump.placement").debug(message, *args)


def _chain_refs(array):
    """The reference counts of ``array`` and of each array its memory is a
    view of, and the object that owns the memory in the end (None: NumPy)."""
    counts = []
    x = array
    while isinstance(x, numpy.ndarray):
        counts.append(sys.getrefcount(x))
        x = x.base
    return counts, x


class _Holder:
    __slots__ = ("array",)


def _orphan_refs():
    """What :func:`_chain_refs` reports for a view of a view that nothing
    but one holder's slot refers to: (the first array's count, a base's),
    measured once on this interpreter, whose reference accounting differs
    between versions."""
    holder = _Holder()
    holder.array = numpy.empty(2)[1:]
    counts, _ = _chain_refs(holder.array)
    return counts[0], counts[1]


_ORPHAN_REFS = _orphan_refs()


def only_view_holds(lease) -> bool:
    """Whether nothing but ``lease`` (the owner of CuPy's view) refers to the
    NumPy array it holds and to the arrays that one views: the program can
    then reach the memory only through CuPy."""
    counts, owner = _chain_refs(lease.array)
    first, base = _ORPHAN_REFS
    return owner is None and counts[0] <= first and all(c <= base for c in counts[1:])


@dataclasses.dataclass
class BlockState:
    on_gpu: int | None = None   # the device ump migrated the block to
    heavy: bool = False         # round trips: GPU time on it beat a migration there and back
    judged: bool = False        # heavy or not by its own measurement, not its size's
    peeked: bool = False        # peek loops: leaving it on the GPU paid
    start: object = None        # event recorded at the hand-off being measured
    start_device: int = -1      # the device that event belongs to
    start_mark: float = 0.0     # the host's waits on that device when it was recorded
    exports: int = 0            # host exports since the last hand-off
    host_seconds: float | None = None  # GPU time of the last interval spent host-resident
    moved: bool = False         # migrated since the last export: the next interval holds its cost
    stay_host: bool = False     # a trial on the GPU lost: host-resident until the next hand-off
    device: int = -1            # the device of its last hand-off
    mark: float = 0.0           # the host's waits on that device at that hand-off
    lease: object = None        # a weak reference to the owner of CuPy's view then
    synced: bool = False        # migrated at another array's read or as an upload since the hand-off
    eager: bool = True          # moved as an upload when only CuPy holds it (until that lost once)
    handoff_moved: bool = False # its last hand-off moved it (heavy, peeked or migrate)
    hold_checks: int = 0        # CuPy allocations left at which to ask if only CuPy holds it
    # Its hand-offs and exports take turns (an export may wait for a move);
    # other blocks' go on meanwhile.
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock, repr=False, compare=False)


@dataclasses.dataclass
class ResultState:
    """A block of CuPy's own that the host reads back."""
    last_wait: float | None = None  # the host's wait at its last export
    lo: int = 0                     # the array exported last: [lo, hi)
    hi: int = 0
    device: int = -1                # host-mapped: the device that maps it over the link
    trial_wait: float = 0.0         # host-mapped: the wait that made ump map it so
    reused_at: float | None = None  # host-mapped: when CuPy handed the array out again
    life: float = 0.0               # host-mapped: the last such life, up to its export
    slow: int = 0                   # host-mapped: waits not under half the trial's since a faster life
    retired: bool = False           # host-mapped lost: it stays on the GPU

    @property
    def host_mapped(self) -> bool:
        return self.device >= 0


class Placement:
    """The placement policy of one enabled managed backend."""

    def __init__(self, cupy, options, headroom: int, watch=None):
        self.cupy = cupy
        self.mode = options.placement
        self.min_bytes = options.prefetch_min
        self.headroom = headroom
        self.blocks: dict[tuple[int, int], BlockState] = {}
        self.results: dict[tuple[int, int], ResultState] = {}
        self.mapped: dict[tuple[int, int], ResultState] = {}  # the results now host-mapped
        #: Blocks handed over whose CuPy view may still be read by kernels,
        #: host-resident: weighed at every wait (:meth:`on_sync`).
        self.pending: dict[tuple[int, int], BlockState] = {}
        #: Block sizes whose last verdict was heavy: a block of such a size
        #: with no verdict of its own is heavy (:meth:`_verdict`).
        self.heavy_sizes: set[int] = set()
        self.waits: dict[int, float] = {}  # device -> seconds the host waited for it
        self.wait_ends: dict[int, float] = {}  # device -> when the last counted wait ended
        #: Pending blocks asked at CuPy's allocations whether only CuPy holds
        #: them (the watch is on while any is).
        self.uploads: set[tuple[int, int]] = set()
        #: CuPy's blocks exported to the host for the first time, and their
        #: device: prefetched back at the next CuPy allocation.
        self.returning: dict[tuple[int, int], int] = {}
        #: Switches the watch on CuPy's allocations (:meth:`on_cupy_malloc`)
        #: on or off and answers whether it is on; None: no watch can be had.
        self.watch = watch
        self.clock = time.perf_counter
        # Results are exported, allocated and freed from any thread; the
        # watch must be on whenever a block is mapped. Reentrant: a block's
        # return to the arena can run inside a collection.
        self._lock = threading.RLock()

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
        _log("block %#x (%d bytes) to GPU %d", base, size, device)
        state.on_gpu = device
        state.moved = True

    def _to_host(self, state: BlockState, base: int, size: int, stream, wait: bool) -> None:
        _log("block %#x (%d bytes) back to the host", base, size)
        _core.prefetch(base, size, -1, stream.ptr)
        if wait:
            stream.synchronize()  # else the caller waits for the stream, as CuPy's contract says
        state.on_gpu = None

    def on_handoff(self, kind: str, base: int, size: int, lease=None) -> None:
        """A NumPy array's block is handed to CuPy (``lease``: the owner of
        CuPy's view, which holds the NumPy array while the view lives)."""
        if kind != "managed" or size < self.min_bytes or self.mode == "host":
            return
        if capturing(self.cupy):
            return  # nothing runs until the graph is launched: no event to time, no move
        with self._lock:
            state = self.blocks.get((base, size))
            if state is None:
                if len(self.blocks) >= MAX_BLOCKS:
                    self.blocks.clear()
                    self.heavy_sizes.clear()
                    self.pending.clear()  # followed states no export could reach any more
                    self.uploads.clear()
                state = self.blocks[(base, size)] = BlockState()
        with state.lock:
            if not state.judged and size in self.heavy_sizes:
                state.heavy = True  # no verdict of its own yet: its size's stands
            self._judge_move(state, size)
            moved = state.handoff_moved = self._handoff(state, base, size)
            # A block not moved now is weighed from here, wherever an earlier
            # hand-off's move left it (the host may have written it since).
            self._follow(state, base, size, None if moved else lease)

    def _follow(self, state: BlockState, base: int, size: int, lease) -> None:
        """Weigh a host-resident block at the waits to come (auto only)."""
        key = (base, size)
        with self._lock:
            self._unfollow(key)
            if self.mode != "auto":
                self._unwatch()
                return
            state.device = self.cupy.cuda.runtime.getDevice()
            state.mark = self.waits.get(state.device, 0.0)
            if lease is None:
                self._unwatch()
                return
            state.lease = weakref.ref(lease)
            if len(self.pending) >= MAX_PENDING:
                self._unfollow(next(iter(self.pending)))
            self.pending[key] = state
            if state.eager and self.watch is not None and self.watch(True):
                state.hold_checks = HOLD_CHECKS
                self.uploads.add(key)

    def _unfollow(self, key) -> None:
        """Weigh the block no more (under ``_lock``). A block still asked
        about at CuPy's allocations is asked no more, and the watch goes off
        if nothing else needs it: left on, every later CuPy allocation of the
        process would run the policy's Python (a move at a wait, or a view
        found gone there, ends the questions before they run out)."""
        self.pending.pop(key, None)
        if key in self.uploads:
            self.uploads.discard(key)
            self._unwatch()

    def _verdict(self, state: BlockState, size: int, heavy: bool) -> None:
        """The block's own verdict, which blocks of its size with none of their own take on."""
        state.heavy, state.judged = heavy, True
        if heavy:
            self.heavy_sizes.add(size)
        else:
            self.heavy_sizes.discard(size)

    def _judge_move(self, state: BlockState, size: int) -> None:
        """At the end of an interval in which the block moved between reads
        or as an upload (its export, or the next hand-off): whether the
        GPU's work since paid for a move there and back. An upload that did
        not (a program loading one array after another into the same
        memory, one pass each) is not moved as an upload again: the memory
        goes back to NumPy, whose next writes fault it back. A heavy block
        moved at its hand-off and handed over again with no export is judged
        here too, by the waits, as :meth:`_reconsider_heavy` judges a round
        trip."""
        work = self.waits.get(state.device, 0.0) - state.mark  # the host's waits since the hand-off
        if state.handoff_moved and state.exports == 0 and state.heavy and self.mode == "auto":
            # Moved at its hand-off and handed over again with no export, so
            # no round trip was timed: the waits judge it as _reconsider_heavy
            # does (none at all says nothing; the pages stay on the GPU
            # until the host touches them either way).
            state.handoff_moved = False
            if 0 < work * LINK_OVER_HBM < size * MIGRATION_SECONDS_PER_BYTE / 2:
                self._verdict(state, size, False)
        if not state.synced:
            return
        state.synced = False
        paid = work * (1 - 1 / LINK_OVER_HBM) > size * MIGRATION_SECONDS_PER_BYTE
        self._verdict(state, size, paid)
        if not paid:
            state.eager = False

    def _handoff(self, state: BlockState, base: int, size: int) -> bool:
        """Whether the block moves to the GPU at this hand-off."""
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
            if state.heavy and not state.peeked and state.on_gpu is not None:
                self._start(state)  # after the prefetch: the kernels alone are timed
            return state.on_gpu is not None
        self._start(state)
        return False

    def _start(self, state: BlockState) -> None:
        """Record the event the next export measures from, on the current
        stream (the first hand-off since the last export counts)."""
        if state.start is None:
            cuda = self.cupy.cuda
            state.start = cuda.Event()
            state.start.record()
            state.start_device = cuda.runtime.getDevice()
            state.start_mark = self.waits.get(state.start_device, 0.0)

    def on_host_export(self, kind: str, base: int, size: int, waited: float | None = None,
                       stream=None) -> None:
        """A block goes back to the host (``waited``: seconds the host just
        waited for the GPU, None if it did not wait; ``stream``: the stream
        it waited for, the current one if None): learn from the GPU time it
        took, and move it if that pays."""
        state = self.blocks.get((base, size)) if kind == "managed" else None
        if state is None:
            return
        if capturing(self.cupy):
            return  # an event recorded or a stream waited for now would break the capture
        with self._lock:
            self._unfollow((base, size))  # with the host now
        with state.lock:
            self._export(state, base, size, waited,
                         self.cupy.cuda.get_current_stream() if stream is None else stream)

    def _export(self, state: BlockState, base: int, size: int, waited: float | None, stream) -> None:
        state.exports += 1
        # A block moved since its hand-off is heavy if its work paid for the
        # move there and back, as a round trip's does.
        self._judge_move(state, size)
        if state.on_gpu is not None and state.start is not None:
            # A heavy block's round trip on the GPU, timed from the migration's end.
            self._reconsider_heavy(state, size, self._elapsed(state, stream, waited))
        seconds = self._gpu_seconds(state, stream, waited)
        if state.on_gpu is None:
            self._learn_host_resident(state, base, size, stream, seconds)
        elif self.mode == "migrate" or (state.exports == 1 and not state.peeked):
            # Right after a hand-off the host may read all of it (round trips).
            self._to_host(state, base, size, stream, waited is not None)
        else:
            self._learn_gpu_resident(state, base, size, stream, seconds, waited is not None)

    def _gpu_seconds(self, state: BlockState, stream, waited: float | None) -> float | None:
        """The GPU time the block's work cost since the hand-off (its event,
        no more than the host waited since: this export's wait and every
        earlier one, the program's own synchronisations included) or the
        last export (the host's wait alone)."""
        if state.start is None:
            return waited
        elapsed = self._elapsed(state, stream, waited)
        if elapsed is None:
            return None
        # A program that waits for the GPU itself before it reads
        # (``Stream.synchronize()``, an event's) leaves this export no wait
        # of its own: its waits since the hand-off bound the work instead.
        since = self.waits.get(state.start_device, 0.0) - state.start_mark
        return min(elapsed, max(waited, since))

    def _elapsed(self, state: BlockState, stream, waited: float | None) -> float | None:
        """Seconds on the GPU's clock from the hand-off's event to now, which
        uses the event up."""
        cuda = self.cupy.cuda
        start, state.start = state.start, None
        # A measurement needs the host's wait (a non-blocking get() has
        # none) and both events on one device.
        if waited is None or state.start_device != cuda.runtime.getDevice():
            return None
        end = cuda.Event()
        end.record(stream)
        end.synchronize()
        if not start.done:
            # With sync="stream" the host waited for one stream; the hand-off
            # was on another, which still has work queued.
            return None
        return cuda.get_elapsed_time(start, end) / 1e3

    def _reconsider_heavy(self, state: BlockState, size: int, elapsed: float | None) -> None:
        """A heavy block whose kernels on the GPU took so little that, over
        the link, they would have cost under half a migration there and back
        is host-resident from its next hand-off. The time is not capped by
        the host's wait, unlike the one that made the block heavy: GPU idle
        time only overstates the work, so an error keeps the block heavy."""
        if elapsed is not None and elapsed * LINK_OVER_HBM < size * MIGRATION_SECONDS_PER_BYTE / 2:
            self._verdict(state, size, False)

    def _learn_host_resident(self, state: BlockState, base: int, size: int, stream,
                             seconds: float | None) -> None:
        if seconds is None or self.mode != "auto":
            return
        if state.exports == 1 and seconds > size * MIGRATION_SECONDS_PER_BYTE:
            self._verdict(state, size, True)  # measured from the hand-off: a round trip's work
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

    # --- work between other arrays' reads ------------------------------------
    def on_sync(self, device: int, waited: float | None, exclude=None, ended: float | None = None) -> None:
        """The host waited ``waited`` seconds for ``device`` (None: it did
        not wait), until ``ended`` (``perf_counter``; None: no other thread
        waits); ``exclude``: the block being exported, which its export
        decides. A host-resident block whose CuPy view lives, and on whose
        device the GPU has worked long enough since its hand-off that
        reading it over the link would have lost more than its migration
        costs, is migrated there."""
        if self.mode != "auto" or waited is None:
            return
        with self._lock:
            if ended is not None:
                # Threads waiting at once wait for the same GPU time: count
                # only what no other wait counted.
                last = self.wait_ends.get(device, 0.0)
                waited = max(0.0, ended - max(ended - waited, last))
                self.wait_ends[device] = max(last, ended)
            total = self.waits[device] = self.waits.get(device, 0.0) + waited
            if not self.pending:
                return  # nothing followed: the total is all a wait changes (a solver's every step)
            due = []
            for key, state in list(self.pending.items()):
                if key == exclude or state.device != device:
                    continue
                lease = state.lease()
                if lease is None:  # CuPy dropped its view: no kernel can reach it anew
                    self._unfollow(key)
                    continue
                lost = (total - state.mark) * (1 - 1 / LINK_OVER_HBM)
                if lost > key[1] * ONE_WAY_SECONDS_PER_BYTE:
                    due.append((key, state, lease, lost))
        for key, state, lease, lost in due:
            # One way for an upload, unless this block's uploads were seen
            # to come back to NumPy (its memory reused, faulted back).
            orphan = state.eager and only_view_holds(lease)
            cost = key[1] * (ONE_WAY_SECONDS_PER_BYTE + (0 if orphan else HOST_FAULTS_SECONDS_PER_BYTE))
            if lost > cost and self._migrate_pending(key, state, device, state.mark):
                _log("block %#x (%d bytes) to GPU %d at another array's read: %.4f s lost over "
                     "the link since its hand-off, moving costs %.4f s (only CuPy holds it: %s)",
                     key[0], key[1], device, lost, cost, orphan)

    def _migrate_pending(self, key, state: BlockState, device: int, mark: float) -> bool:
        """Move a followed block to ``device``, unless it was exported or
        handed over again since ``mark`` was read; whether it moved. Runs
        inside waits and CuPy's allocations, which must not fail over a
        placement."""
        cuda = self.cupy.cuda
        with state.lock:
            with self._lock:
                if self.pending.get(key) is not state or state.mark != mark:
                    return False
            try:
                with cuda.Device(device):
                    if capturing(self.cupy):
                        return False  # a prefetch now would break the capture; a later wait decides
                    with self._lock:
                        self._unfollow(key)
                    state.start = None  # the hand-off's round trip is timed no more
                    self._to_gpu(state, key[0], key[1], cuda.get_current_stream())
            except RuntimeError as err:  # UmpError or CuPy's: the block stays where it is
                _log("block %#x (%d bytes) not moved: %s", key[0], key[1], err)
                return False
            state.synced = state.on_gpu is not None
            return state.synced

    # --- results the host reads back -----------------------------------------
    def close(self) -> None:
        """Put every host-mapped result back on the GPU (``disable()``: the
        memory outlives the watch)."""
        with self._lock:
            for key, state in list(self.mapped.items()):
                self._to_gpu_for_good(key, state)

    def on_result_export(self, base: int, size: int, lo: int, hi: int, device: int,
                         waited: float | None) -> None:
        """The host takes ``[lo, hi)`` of CuPy's managed block ``(base,
        size)`` on ``device`` after waiting ``waited`` seconds for the GPU
        (None: no wait, as during a graph capture)."""
        if (self.mode != "auto" or size < self.min_bytes or waited is None
                or lo != base or 2 * (hi - lo) <= size):
            return  # only an array covering most of its block is followed
        if capturing(self.cupy):
            return  # get(stream=other) with sync="stream": advice now would break the capture
        key = (base, size)
        with self._lock:
            state = self.results.get(key)
            if state is None:
                if len(self.results) >= MAX_BLOCKS:
                    self.results = dict(self.mapped)
                state = self.results[key] = ResultState()
                if self.watch is not None and self.watch(True):
                    self.returning[key] = device  # read once: back to the GPU for its next kernels
            if state.host_mapped:
                new_life = state.reused_at is not None
                if new_life:
                    state.life, state.reused_at = self.clock() - state.reused_at, None
                # Not under half the trial's wait twice, with no faster life
                # between: the kernels on it do more than write it once (one
                # slow wait alone may be a stalled host or another process's
                # kernels). Reading the same array again is no faster life.
                if 2 * waited >= state.trial_wait:
                    state.slow += 1
                elif new_life:
                    state.slow = 0
                if state.slow >= SLOW_LIVES:
                    self._to_gpu_for_good(key, state)
            elif (not state.retired and state.last_wait is not None
                  and waited > size * ONE_WAY_SECONDS_PER_BYTE):
                self._to_host_mapped(key, state, device, waited)
            if state.host_mapped:
                self.returning.pop(key, None)  # it lives in host memory now
            state.last_wait, state.lo, state.hi = waited, lo, hi
            self._check_lives()

    def _check_uploads(self) -> None:
        """At a CuPy allocation: migrate the blocks handed over that nothing
        but CuPy's view holds any more; stop asking about a block after
        :data:`HOLD_CHECKS` allocations."""
        due = []
        with self._lock:
            for key in list(self.uploads):
                state = self.pending.get(key)
                lease = None if state is None else state.lease()
                if lease is not None and only_view_holds(lease):
                    due.append((key, state))
                elif lease is not None and state.hold_checks > 1:
                    state.hold_checks -= 1
                    continue
                self.uploads.discard(key)
            self._unwatch()
        for key, state in due:
            if self._migrate_pending(key, state, state.device, state.mark):
                _log("block %#x (%d bytes) to GPU %d: only CuPy holds it", key[0], key[1], state.device)

    def _unwatch(self) -> None:
        """Switch the watch off once nothing needs it (under ``_lock``)."""
        if not self.mapped and not self.uploads and not self.returning and self.watch is not None:
            self.watch(False)

    def _send_back(self, ptr: int, size: int) -> None:
        """At a CuPy allocation (``[ptr, ptr + size)``), under ``_lock``:
        prefetch the results exported since to their GPU, whose kernels
        would otherwise fault back each page the host read; one that this
        allocation reuses is left to the rules for results."""
        for (base, bsize), device in self.returning.items():
            if ptr < base + bsize and base < ptr + size:
                continue
            try:
                with self.cupy.cuda.Device(device):
                    if self.prefetch_here(base, bsize, device):
                        _log("result %#x (%d bytes) back to GPU %d", base, bsize, device)
            except RuntimeError:
                pass  # UmpError or CuPy's: the allocation must not fail over a placement
        self.returning.clear()
        self._unwatch()

    def prefetch_here(self, base: int, size: int, device: int) -> bool:
        """With ``device`` current: prefetch a CuPy block there on its current
        stream, unless that is capturing a graph or the block would not fit;
        whether it did."""
        if capturing(self.cupy) or not self._fits(size):
            return False
        _core.prefetch(base, size, device, self.cupy.cuda.get_current_stream().ptr)
        return True

    def on_cupy_malloc(self, ptr: int, size: int) -> None:
        """CuPy's pool handed out ``[ptr, ptr + size)`` (only while the
        watch is on): a host-mapped block that another array now uses goes
        back to the GPU; a block handed over that only CuPy holds now goes
        to it."""
        if capturing(self.cupy):
            return  # no move now (it would invalidate the capture); the next allocation decides
        if self.uploads:
            self._check_uploads()
        with self._lock:
            if self.returning:
                self._send_back(ptr, size)
            now = self.clock()
            for key, state in list(self.mapped.items()):
                base, bsize = key
                if ptr < base + bsize and base < ptr + size:
                    if ptr == state.lo and size >= state.hi - state.lo:
                        state.reused_at = now  # the same array again: the loop goes on
                    else:
                        self._to_gpu_for_good(key, state)
            self._check_lives(now)

    def on_block_freed(self, base: int) -> None:
        """CuPy's pool gave the block at ``base`` back to the arena: the
        arena may hand that memory to any array next."""
        with self._lock:
            for key in [k for k in self.results if k[0] == base]:
                self.returning.pop(key, None)
                state = self.results.pop(key)
                if state.host_mapped:
                    self._to_gpu_for_good(key, state)
            self._unwatch()

    def _check_lives(self, now: float | None = None) -> None:
        """Put back on the GPU a host-mapped array that has lived twice as
        long as the loop's lives did (or the life that started it): its
        kernels are not the loop's."""
        if not self.mapped:
            return
        now = self.clock() if now is None else now
        for key, state in list(self.mapped.items()):
            if (state.reused_at is not None
                    and now - state.reused_at > 2 * max(state.life, state.trial_wait)):
                self._to_gpu_for_good(key, state)

    def _to_host_mapped(self, key, state: ResultState, device: int, waited: float) -> None:
        if self.watch is None or not self.watch(True):
            return  # without the watch a later array in this memory would run over the link
        base, size = key
        state.device, state.trial_wait, state.reused_at, state.slow = device, waited, None, 0
        self.mapped[key] = state
        try:
            _core.advise(base, size, _core.ADVICE["preferred_location"], -1)
            _core.advise(base, size, _core.ADVICE["accessed_by"], device)
        except UmpError:
            self._to_gpu_for_good(key, state)  # the export itself must not fail over a placement

    def _to_gpu_for_good(self, key, state: ResultState) -> None:
        """Undo the advice and move the pages to the block's GPU: its
        mappings of host pages outlive the advice until the pages move."""
        if self.mapped.pop(key, None) is None:
            return
        base, size = key
        device, state.device, state.retired, state.reused_at = state.device, -1, True, None
        self.returning.pop(key, None)  # the prefetch below already sends it back
        self._unwatch()
        cuda = self.cupy.cuda
        try:
            with cuda.Device(device):
                _core.advise(base, size, _core.ADVICE["unset_preferred_location"], -1)
                _core.advise(base, size, _core.ADVICE["unset_accessed_by"], device)
                self.prefetch_here(base, size, device)
        except RuntimeError:
            # UmpError or CuPy's CUDARuntimeError: the allocation or export
            # that got here must not fail over a placement; the block stays
            # where it is.
            pass
