"""The release of NumPy memory that CuPy viewed, in stream order: a NumPy
array handed to CuPy stays alive until a wait for the whole device it was
used on, begun after CuPy dropped its view, has returned."""

from __future__ import annotations

import collections
import sys
import threading

import numpy

from ._cupy_compat import OnePerCupy, OwnWaits, capturing

__all__ = ["ReleaseQueue", "Lease"]


def _owner(array):
    """The outermost NumPy array whose memory ``array`` views (itself if none)."""
    while isinstance(array.base, numpy.ndarray):
        array = array.base
    return array


def _refs_beyond_entries(held: dict):
    """(array, references to it beyond its pending entries) for each array of
    a queue's ``held`` map, counted before it is handed to the caller."""
    for entries, array in held.values():
        yield array, sys.getrefcount(array) - entries


def _queue_refs() -> int:
    """What :func:`_refs_beyond_entries` reports for an array nothing but the
    queue refers to: the queue's own references (its ``held`` entry, the
    count's locals), measured once on this interpreter, whose reference
    accounting differs between versions."""
    probe = numpy.empty(1)
    held, pending = {id(probe): [1, probe]}, collections.deque([(1, probe)])
    del probe
    ((_, refs),) = _refs_beyond_entries(held)
    del pending
    return refs


_QUEUE_REFS = _queue_refs()


class ReleaseQueue(OnePerCupy):
    """NumPy arrays that CuPy views let go of, each kept until the device it
    was used on has been waited for as a whole.

    A kernel on the memory may still be queued, and on any stream of the
    device (a non-blocking stream, a per-thread default stream): an event
    recorded on the stream of the thread that drops the view would not order
    it. So an array is released only by a device-wide wait begun after it was
    deferred: the one every host export does anyway (:meth:`wait_for`),
    or the one :meth:`drain` does when too much is pending. One queue serves
    the process, so arrays dropped after ``disable()`` are released too.
    """

    MAX_PENDING = 4096
    #: Bytes of arrays that only the queue still holds before a drain: an
    #: array the program holds too costs no memory here (a loop handing one
    #: array to CuPy again and again drains once per MAX_PENDING views).
    #: An array is counted by the array that owns its memory, so views of
    #: one base the program holds (``x.T``, ``x[::2]``) cost nothing either.
    MAX_PENDING_BYTES = 256 << 20
    #: Views deferred between two counts of what only the queue holds, when
    #: no new array came: a count walks every array held.
    RECOUNT_EVERY = 64

    def __init__(self, cupy, *, device_count: int | None = None, active_devices=None):
        self.cupy = cupy
        self._device_count = device_count  # read at the first wait when None
        self._active_devices = active_devices or _devices_with_contexts
        self._pending: dict[int, collections.deque] = {}  # device -> (sequence, array)
        self._held: dict[int, list] = {}  # id(owner) -> [entries pending, owner]
        self._count = 0
        self._bytes = 0
        self._counted_at = None  # self._count at the last count of bytes only held here
        # Arrays handed over but not yet queued. defer() runs in Lease.__del__,
        # wherever CuPy's view dies: in a collection inside any allocation,
        # or in this queue's own release of an array (a host view from
        # cupy.asnumpy holds a CuPy view of another NumPy array), so on a
        # thread that may hold the lock. It appends here, which takes no
        # lock, and queues only when the lock is free at once.
        self._inbox: collections.deque = collections.deque()  # (owner, device)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(q) for q in self._pending.values()) + len(self._inbox)

    def defer(self, array, device: int) -> None:
        """Take ``array``, whose view on ``device`` CuPy dropped."""
        self._inbox.append((_owner(array), device))  # holding it keeps the view's memory alive
        if not self._lock.acquire(blocking=False):
            return  # its holder, or the next call, queues it
        try:
            full = self._queue_inbox()
        finally:
            self._lock.release()
        if full:
            self.drain()

    def _queue_inbox(self) -> bool:
        """Queue the arrays handed over (under the lock); whether too much is pending.

        An array is numbered here, not when it was handed over: a number
        past a wait's mark only keeps it longer."""
        while self._inbox:
            owner, device = self._inbox.popleft()
            self._count += 1
            held = self._held.get(id(owner))
            if held is None:
                held = self._held[id(owner)] = [0, owner]
                self._bytes += owner.nbytes
                self._counted_at = None  # a new array: count again
            held[0] += 1
            self._pending.setdefault(device, collections.deque()).append((self._count, owner))
        return len(self) > self.MAX_PENDING or self._over_bytes()

    def _over_bytes(self) -> bool:
        """Whether the arrays only the queue holds are past the bound (under the lock)."""
        if self._bytes <= self.MAX_PENDING_BYTES:
            return False
        if self._counted_at is not None and self._count - self._counted_at < self.RECOUNT_EVERY:
            return False
        self._counted_at = self._count
        only_here = sum(owner.nbytes for owner, refs in _refs_beyond_entries(self._held) if refs <= _QUEUE_REFS)
        return only_here > self.MAX_PENDING_BYTES

    def mark(self) -> int:
        """Call before a device-wide wait; pass the result to :meth:`synchronized`."""
        with self._lock:
            self._queue_inbox()  # handed over before the wait: released by it
            return self._count

    def synchronized(self, device: int, mark: int) -> None:
        """A wait for all of ``device``'s work begun at ``mark`` has returned:
        release what was deferred on it before."""
        released = []  # dropped after the lock: dropping one can hand the queue another
        with self._lock:
            queue = self._pending.get(device)
            while queue and queue[0][0] <= mark:
                owner = queue.popleft()[1]
                held = self._held[id(owner)]
                held[0] -= 1
                if not held[0]:
                    del self._held[id(owner)]
                    self._bytes -= owner.nbytes
                    released.append(owner)

    def wait_for(self, device: int | None = None) -> None:
        """Wait for all of ``device``'s work (the current device's if None),
        and on several GPUs for every GPU with work of this process; then
        release what was deferred on them before the wait began."""
        runtime = self.cupy.cuda.runtime
        if self.one_gpu() and not self._inbox and not any(list(self._pending.values())):
            # One GPU, the current one, and nothing deferred: the wait alone
            # (a solver's scalar read each step comes here). An array
            # deferred meanwhile waits for the next wait, which only keeps
            # it longer. This wait is counted, if at all, by the caller: under
            # ump's wrapper that times the program's waits, CuPy's own call;
            # under any other, the wrapper, inside OwnWaits.
            wait = runtime.deviceSynchronize
            mine = getattr(wait, "ump_wrapped", None)  # (ump's wrapper, CuPy's call), wrap_waits
            if mine is not None and mine[0] is wait:
                mine[1]()
            else:
                with OwnWaits():
                    wait()
            return
        current = runtime.getDevice()
        self._wait([current if device is None else device], current)

    def drain(self) -> None:
        """Wait for every device with pending arrays and release them all;
        while the current stream captures a CUDA graph (a wait would
        invalidate the capture), keep them for a later wait."""
        if capturing(self.cupy):
            return
        with self._lock:
            self._queue_inbox()
            pending = [d for d, q in self._pending.items() if q]
        if pending:
            self._wait(pending, self.cupy.cuda.runtime.getDevice())

    def one_gpu(self) -> bool:
        """Whether the process sees one GPU (its device count, read at the
        first wait): a wait for it waits for all its work."""
        if self._device_count is None:
            self._device_count = self.cupy.cuda.runtime.getDeviceCount()
        return self._device_count == 1

    def _wait(self, devices: list[int], current: int) -> None:
        cuda = self.cupy.cuda
        mark = self.mark()
        if not self.one_gpu():
            # A kernel or copy on one GPU writes another's memory through
            # peer access (CuPy runs a cross-device copy on the current
            # device): the memory's own device may have nothing queued.
            devices = sorted(set(devices).union(self._active_devices()))
        with OwnWaits():  # the queue's waits, not the program's
            for d in devices:
                if d == current:
                    cuda.runtime.deviceSynchronize()
                else:
                    with cuda.Device(d):
                        cuda.runtime.deviceSynchronize()
        for d in devices:
            self.synchronized(d, mark)


def _devices_with_contexts() -> list[int]:
    """The GPUs on which this process has an active primary context (CuPy's
    and ump's): the only ones that can have work of it queued. One driver
    call per GPU: this runs at every host export on a machine with several
    GPUs."""
    from . import _driver
    from ._errors import UmpError
    from ._probe import probe

    try:
        return _driver.active_devices(len(probe().devices))
    except UmpError as err:
        raise UmpError(f"finding the GPUs to wait for: {err}") from err


class Lease:
    """Owner of a CuPy view of NumPy memory: hands the NumPy array to the
    release queue when CuPy drops the view."""

    __slots__ = ("array", "queue", "device", "__weakref__")  # the placement follows it weakly

    def __init__(self, array, queue: ReleaseQueue, device: int):
        self.array = array
        self.queue = queue
        self.device = device

    def __del__(self):
        try:
            self.queue.defer(self.array, self.device)
        except Exception:  # interpreter shutdown: nothing runs any more
            pass
