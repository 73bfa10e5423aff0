"""Random call sequences with hostile arguments over the public pool, sharing
and allocator API (hypothesis stateful tests), and scripted hostile peers:
real processes that connect to a listener and lie.

The machines run on the emulated layer (the same C as on a GPU, minus the
driver calls), so on every machine and in CI. What they check after every
step: the pool's statistics against a model of what is live, the data of
every live block and view against the pattern written into it, and that
every refusal is a clear exception (never a crash, a truncated size, a
leaked descriptor). On a failure hypothesis prints the steps that make it
and a ``@reproduce_failure`` blob; ``--hypothesis-seed=N`` replays a run.
The C core under ASan/UBSan gets the same treatment from tests/c/fuzz.c
(test_sanitizers.py).
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import socket
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz harness needs hypothesis: pip install -e '.[test]'")
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test  # noqa: E402

import ump  # noqa: E402
import ump.share  # noqa: E402
from _hostile_peer import start as start_peer  # noqa: E402
from ump import _core  # noqa: E402
from ump._vmm import VMMPool  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and SCM_RIGHTS are Linux's")

MiB = 1 << 20
GRAN = 2 * MiB

#: Steps each machine runs per test: examples x steps per example.
EXAMPLES, STEPS = int(os.environ.get("UMP_FUZZ_EXAMPLES", 200)), 50
RUN = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
               print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

#: What refusing hostile input may raise: never anything else, never a crash.
REFUSED = (ValueError, TypeError, ump.UmpError, OSError)

# Sizes as a careless caller or a lying peer gives them.
hostile = st.one_of(
    st.integers(0, 3 * MiB),
    st.sampled_from([0, 1, 511, 512, GRAN - 1, GRAN, GRAN + 1, 2**47, 2**48, 2**63, 2**64 - 1, 2**64,
                     2**64 + 512, 2**64 + GRAN, 2**128, -1, -GRAN]),
    st.integers(-(2**70), 2**70),
)
granule_sizes = st.one_of(st.integers(1, 3).map(lambda k: k * GRAN), hostile)
# Sizes that succeed stay small (a realloc copies what it keeps), the rest fail.
hook_sizes = st.one_of(st.integers(0, 4 * MiB),
                       st.sampled_from([0, 1, 511, 512, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, 2**47, 2**62,
                                        2**64 - 1, 2**64, 2**64 + 512, 2**70, -1]))
# A buffer's granule map costs 8 bytes of host memory per granule it may
# span: the sizes that succeed stay below 1 GiB.
buffer_sizes = st.one_of(st.integers(1, 64 * MiB), st.sampled_from([0, -1, 2**47 + 1, 2**64, 2**64 + GRAN]))
streams = st.one_of(st.integers(0, 3), st.integers(4, 2**64 - 1), st.sampled_from([-1, 2**64]))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rounded(n: int) -> int:
    return max(-(-n // 512) * 512, 512)


def _stamp(ptr: int, n: int, tag: int) -> None:
    for at in {0, n // 2, max(n - 1, 0)}:
        ctypes.memset(ptr + at, tag, 1)


def _stamped(ptr: int, n: int, tag: int) -> bool:
    return all(ctypes.string_at(ptr + at, 1)[0] == tag for at in {0, n // 2, max(n - 1, 0)})


def _take(data, live: dict) -> tuple[int, int]:
    """A block of the model drawn at random and taken out of it, its data
    checked: (address, size). Every block has a byte, 0-byte ones too."""
    ptr = data.draw(st.sampled_from(sorted(live)))
    n, tag = live.pop(ptr)
    assert _stamped(ptr, n, tag)
    return ptr, n


class Counted(RuleBasedStateMachine):
    """Counts the steps its subclasses run (the harness's size is asserted)."""

    steps: collections.Counter

    def __init__(self):
        super().__init__()
        self.fds = _open_fds()

    def count(self, name: str) -> None:
        type(self).steps[name] += 1


# --- the pool: blocks, buffers, views, in-process export and import ------------------

class PoolMachine(Counted):
    steps = collections.Counter()

    def __init__(self):
        super().__init__()
        self.pool = VMMPool(emulate=True, reserve=256 * MiB, limit=96 * MiB)
        self.blocks = {}   # ptr -> (size, tag)
        self.buffers = []  # (GrowableBuffer, tag)
        self.views = []    # (MappedMemory, tag)
        self.tag = 0

    def next_tag(self) -> int:
        self.tag = self.tag % 250 + 1
        return self.tag

    # blocks ---------------------------------------------------------------------
    @rule(size=hostile, stream=streams)
    def allocate(self, size, stream):
        self.count("allocate")
        try:
            ptr = self.pool.allocate(size, stream)
        except REFUSED as err:
            valid = type(size) is int and 0 <= size < 2**64 and 0 <= stream < 2**64
            assert not valid or isinstance(err, ump.OutOfMemoryError), err
            return
        assert 0 <= size <= 256 * MiB and ptr % 512 == 0 and ptr not in self.blocks
        tag = self.next_tag()
        _stamp(ptr, size, tag)
        self.blocks[ptr] = (size, tag)

    @rule(size=st.integers(0, 3 * MiB), stream=st.integers(0, 3))
    def allocate_small(self, size, stream):
        self.allocate(size, stream)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def deallocate(self, data):
        self.count("deallocate")
        ptr, _ = _take(data, self.blocks)
        self.pool.deallocate(ptr)
        with pytest.raises(ValueError, match="not a live block"):
            self.pool.deallocate(ptr)  # double free

    @rule(data=st.data(), delta=st.sampled_from([512, 1, -512, 2**64, -(2**64), 2**65, 4096]))
    def bad_deallocate(self, data, delta):
        self.count("bad_deallocate")
        base = data.draw(st.sampled_from(sorted(self.blocks))) if self.blocks else 4096
        ptr = base + delta
        if ptr in self.blocks:
            return
        before = self.pool.statistics()
        with pytest.raises(ValueError):
            self.pool.deallocate(ptr)
        after = self.pool.statistics()
        assert (after.used_bytes, after.current_count) == (before.used_bytes, before.current_count)

    @rule(keep=st.booleans())
    def trim(self, keep):
        self.count("trim")
        self.pool.trim(keep_handles=keep)

    @rule(limit=st.one_of(st.integers(1, 160).map(lambda k: k * MiB), hostile))
    def set_limit(self, limit):
        self.count("set_limit")
        try:
            self.pool.set_limit(limit)
        except REFUSED:
            assert not (type(limit) is int and 0 <= limit < 2**63)
            return
        if not 0 < limit <= 256 * MiB:
            self.pool.set_limit(96 * MiB)  # else a view of 2**46 bytes is made: slow, not wrong

    @precondition(lambda self: self.blocks)
    @rule(data=st.data(), size=hostile, device=st.one_of(st.integers(0, 2), st.sampled_from([-1, 2**31, 2**32])))
    def where_and_migrate(self, data, size, device):
        self.count("migrate")
        ptr = data.draw(st.sampled_from(sorted(self.blocks)))
        n, tag = self.blocks[ptr]
        for call in (lambda: self.pool.device_of(ptr, size), lambda: self.pool.migrate(ptr, size, device)):
            try:
                call()
            except REFUSED:
                pass
        assert _stamped(ptr, n, tag)  # moved or not, the data stays

    # buffers --------------------------------------------------------------------
    @precondition(lambda self: len(self.buffers) < 4)
    @rule(max_bytes=buffer_sizes, size=hostile)
    def buffer(self, max_bytes, size):
        self.count("buffer")
        try:
            buf = self.pool.buffer(max_bytes)
        except REFUSED:
            return
        tag = self.next_tag()
        try:
            buf.resize(size)
        except REFUSED:
            pass
        if buf.size:
            _stamp(buf.ptr, buf.size, tag)
        self.buffers.append((buf, tag))

    @precondition(lambda self: self.buffers)
    @rule(data=st.data(), size=hostile)
    def resize_or_close_buffer(self, data, size):
        self.count("resize_buffer")
        i = data.draw(st.integers(0, len(self.buffers) - 1))
        buf, tag = self.buffers[i]
        old = buf.size
        if old:
            assert _stamped(buf.ptr, old, tag)
        if data.draw(st.booleans()):
            buf.close()
            del self.buffers[i]
            return
        try:
            buf.resize(size)
        except REFUSED:
            assert buf.size == old
            return
        if buf.size:
            _stamp(buf.ptr, buf.size, tag)

    # views ----------------------------------------------------------------------
    @precondition(lambda self: len(self.views) < 6)
    @rule(kind=st.sampled_from(["shared", "ring", "striped", "alias"]), size=granule_sizes, data=st.data())
    def view(self, kind, size, data):
        self.count("view")
        try:
            if kind == "alias":
                if not self.blocks:
                    return
                ptr = data.draw(st.sampled_from(sorted(self.blocks)))
                mem = self.pool.alias(ptr + data.draw(st.sampled_from([0, 512, 2**64])), size)
            else:
                mem = {"shared": self.pool.allocate_shared, "ring": self.pool.ring,
                       "striped": lambda n: self.pool.striped(n, [0, 1])}[kind](size)
        except REFUSED:
            return
        assert mem.nbytes <= mem.mapped_bytes  # never more than C mapped
        if kind == "alias":
            mem.close()  # its block may be freed next
            return
        tag = self.next_tag()
        a = mem.array()
        a[0] = a[-1] = tag
        del a
        self.views.append((mem, tag))

    @precondition(lambda self: len(self.views) < 6)
    @rule(size=st.integers(1, 2).map(lambda k: k * GRAN))
    def shared(self, size):
        self.view("shared", size, None)  # memory to export, for the rule below

    @precondition(lambda self: self.views)
    @rule(data=st.data(), shape=st.lists(st.one_of(st.integers(0, 64), st.integers(2**31, 2**64)), max_size=3))
    def array_of_any_shape(self, data, shape):
        self.count("array")
        mem, tag = data.draw(st.sampled_from(self.views))
        try:
            a = mem.array(tuple(shape), "uint8")
        except REFUSED:
            return
        assert a.nbytes <= mem.nbytes

    @precondition(lambda self: self.views)
    @rule(data=st.data())
    def close_view(self, data):
        self.count("close_view")
        i = data.draw(st.integers(0, len(self.views) - 1))
        mem, tag = self.views.pop(i)
        a = mem.array()
        assert a[0] == tag and a[-1] == tag
        del a
        mem.close()

    @precondition(lambda self: any(m.kind == "shared" for m, _ in self.views))
    @rule(data=st.data(), lie=st.sampled_from(["none", "size", "nbytes", "granularity", "device", "emulated",
                                                "fd-closed", "fd-foreign", "fd-unsealed"]),
          value=hostile)
    def export_and_import(self, data, lie, value):
        self.count("import")
        mem, tag = data.draw(st.sampled_from([v for v in self.views if v[0].kind == "shared"]))
        handle = mem.export()
        fields = dict(size=handle.size, nbytes=handle.nbytes, granularity=handle.granularity,
                      device=handle.device, emulated=handle.emulated)
        fd = os.dup(handle.fd)
        handle.close()
        if lie in fields:
            fields[lie] = not fields[lie] if lie == "emulated" else value
        elif lie == "fd-closed":
            os.close(fd)
            fd = os.open(os.devnull, os.O_RDONLY)
            os.close(fd)  # a number that names nothing (nothing opens in between)
        elif lie == "fd-foreign":
            os.close(fd)
            fd = os.open(os.devnull, os.O_RDWR)
        elif lie == "fd-unsealed":
            os.close(fd)
            fd = os.memfd_create("ump-vmm-shared")
            os.ftruncate(fd, fields["nbytes"])
        # What still describes the memory truly (the emulation ignores device).
        truthful = (lie == "none"
                    or (lie == "size" and type(value) is int and 0 < value <= fields["nbytes"])
                    or (lie == "nbytes" and value == mem.mapped_bytes and fields["size"] <= value)
                    or (lie == "granularity" and value == GRAN)
                    or (lie == "device" and type(value) is int and 0 <= value < 2**31))
        peer = ump.ExportHandle(fd, **fields)
        try:
            got = self.pool.import_handle(peer)
        except REFUSED as err:
            assert not truthful, err
            return
        finally:
            if lie == "fd-closed":
                peer._fd = None  # the number may name another descriptor by now
            peer.close()
        assert truthful, (lie, value)
        assert 0 < got.nbytes <= got.mapped_bytes
        a = got.array()
        assert a[0] == tag  # the same memory
        del a
        got.close()

    # what must hold after every step -----------------------------------------------
    @invariant()
    def model_matches(self):
        st_ = self.pool.statistics()
        assert st_.used_bytes == sum(_rounded(n) for n, _ in self.blocks.values())
        assert st_.current_count == len(self.blocks)
        assert st_.views == len(self.views) and st_.stream_bins <= 64
        assert st_.buffer_bytes == sum(b.size for b, _ in self.buffers)
        for ptr, (n, tag) in self.blocks.items():
            assert _stamped(ptr, n, tag)

    def teardown(self):
        for ptr in list(self.blocks):
            self.pool.deallocate(ptr)
        for buf, _ in self.buffers:
            buf.close()
        for mem, _ in self.views:
            mem.close()
        self.pool.trim()
        st_ = self.pool.statistics()
        assert (st_.used_bytes, st_.views, st_.physical_bytes, st_.imported_bytes) == (0, 0, 0, 0)
        self.pool.close()
        assert _open_fds() == self.fds  # no descriptor left behind


# --- NumPy's hooks: malloc, calloc, realloc, free, past and under the cap --------

class HookMachine(Counted):
    steps = collections.Counter()

    def __init__(self):
        super().__init__()
        # A budget of its own (device 23: no other test's), serving the hooks.
        self.arena = _core.Arena("host", _core.PROVIDER_HOST, 64 * MiB, device=23)
        self.previous = _core.get_numpy_arena()
        _core.set_numpy_arena(self.arena.id)
        self.live = {}  # ptr -> (size, tag)
        self.fallback = _core.fallback_statistics().current_count
        self.foreign = _core.foreign_frees()
        self.refused_frees = 0

    @rule(size=hook_sizes, zeroed=st.booleans(), nmemb=st.sampled_from([1, 3, 2**33]))
    def allocate(self, size, zeroed, nmemb):
        self.count("allocate")
        try:
            ptr = _core.calloc(nmemb, size) if zeroed else _core.malloc(size)
        except ValueError:
            assert not 0 <= size < 2**64
            return
        if not ptr:
            return  # refused (overflow, no memory): NULL, never a short block
        n = nmemb * size if zeroed else size  # 8 GiB of zeros is fine: pages on demand
        self.live[ptr] = (n, len(self.live) % 250 + 1)
        assert ptr % 512 == 0
        if zeroed:
            assert ctypes.string_at(ptr, min(n, 64)) == bytes(min(n, 64))
        _stamp(ptr, n, self.live[ptr][1])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), size=hook_sizes)
    def reallocate(self, data, size):
        self.count("reallocate")
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        n, tag = self.live[ptr]
        try:
            new = _core.realloc(ptr, size)
        except ValueError:
            return
        if not new:
            assert _stamped(ptr, n, tag)  # the old block stays valid
            return
        del self.live[ptr]
        assert ctypes.string_at(new, 1)[0] == tag  # the first byte is kept
        self.live[new] = (size, tag)
        _stamp(new, size, tag)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.count("free")
        ptr, n = _take(data, self.live)
        _core.free(ptr, n)
        _core.free(ptr, n)  # double free: counted, ignored
        self.refused_frees += 1

    @rule(data=st.data(), delta=st.sampled_from([512, -512, 1, 2**64, -(2**64)]))
    def bad_free(self, data, delta):
        self.count("bad_free")
        base = data.draw(st.sampled_from(sorted(self.live))) if self.live else 1 << 20
        ptr = base + delta
        if ptr in self.live:
            return
        try:
            _core.free(ptr, 64)
        except ValueError:
            assert not 0 <= ptr < 2**64
            return
        self.refused_frees += 1

    @rule(cap=st.one_of(st.integers(0, 80).map(lambda k: k * MiB), hook_sizes))
    def set_cap(self, cap):
        self.count("set_cap")
        try:
            self.arena.set_cap(cap)
        except ValueError:
            assert not 0 <= cap < 2**64

    @rule()
    def trim(self):
        self.count("trim")
        self.arena.trim()

    @invariant()
    def data_intact(self):
        for ptr, (n, tag) in self.live.items():
            assert _stamped(ptr, n, tag)
        assert _core.foreign_frees() - self.foreign == self.refused_frees

    def teardown(self):
        for ptr, (n, _) in self.live.items():
            _core.free(ptr, n)
        _core.set_numpy_arena(self.previous)
        self.arena.set_cap(64 * MiB)
        self.arena.trim()
        assert _core.fallback_statistics().current_count == self.fallback
        assert self.arena.statistics().current_count == 0


# --- sockets: what a peer may send over a Connection ------------------------------

class SocketMachine(Counted):
    steps = collections.Counter()

    def __init__(self):
        super().__init__()
        self.pool = VMMPool(emulate=True, reserve=GRAN, limit=16 * MiB)
        self.mem = self.pool.allocate_shared(GRAN)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sender, self.receiver = ump.share.Connection(a, timeout=5), ump.share.Connection(b, timeout=5)

    def _fds(self, kind: str) -> list[int]:
        if kind == "none":
            return []
        if kind == "memory":
            with self.mem.export() as h:
                return [os.dup(h.fd)]
        if kind == "two":
            return self._fds("memory") + [os.open(os.devnull, os.O_RDONLY)]
        if kind == "pipe":
            r, w = os.pipe()
            os.close(w)
            return [r]
        return [os.open(os.devnull, os.O_RDWR)]

    @rule(honest=st.booleans(), fds=st.sampled_from(["memory", "none", "two", "pipe", "devnull"]),
          meta=st.one_of(
              st.fixed_dictionaries({"size": hostile, "nbytes": hostile, "granularity": hostile,
                                     "device": hostile, "emulated": st.booleans(), "pid": hostile}),
              st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                 max_size=3), max_leaves=8)),
          raw=st.one_of(st.none(), st.binary(max_size=64), st.just(b"x" * 5000)))
    def receive(self, honest, fds, meta, raw):
        self.count("receive")
        if honest:
            with self.mem.export() as h:
                msg = json.dumps(h._meta()).encode()
            sent = self._fds("memory")
        else:
            msg = raw if raw is not None else json.dumps(meta).encode()
            sent = self._fds(fds)
        try:
            socket.send_fds(self.sender._sock, [msg], sent)
        finally:
            for fd in sent:
                os.close(fd)  # the receiver's copies are in flight
        try:
            got = self.receiver.recv()
        except (ump.UmpError, EOFError) as err:
            assert not honest, err
            return
        with got:
            assert not os.get_inheritable(got.fd)
            try:
                imported = self.pool.import_handle(got)
            except REFUSED as err:
                assert not honest, err
                return
            # a lie that happens to be the truth maps the memory, no more
            assert 0 < imported.nbytes <= imported.mapped_bytes
            imported.close()

    def teardown(self):
        self.sender.close()
        self.receiver.close()
        self.mem.close()
        assert self.pool.statistics().views == 0
        self.pool.close()
        assert _open_fds() == self.fds


@pytest.mark.parametrize("machine", [PoolMachine, HookMachine, SocketMachine], ids=lambda m: m.__name__)
def test_random_hostile_call_sequences(machine, record_property):
    machine.steps.clear()
    run_state_machine_as_test(machine, settings=RUN)
    total = sum(machine.steps.values())
    record_property("steps", total)
    print(f"{machine.__name__}: {total} steps {dict(machine.steps)}")
    assert total >= EXAMPLES * STEPS // 2, dict(machine.steps)


# --- scripted hostile peers: real processes that lie ------------------------------

#: scenario -> what the receiver (recv, then import) must raise
SCENARIOS = {
    "size-past-memory": ump.UmpError,       # size > nbytes
    "nbytes-past-2-64": ValueError,         # the truncation of item 1
    "nbytes-past-memory": ump.UmpError,     # 2 MiB of memory described as 4
    "granularity-2-46": ump.UmpError,
    "foreign-fd": ump.UmpError,             # /dev/null
    "unsealed-memfd": ump.UmpError,         # the right name, shrinkable
    "pipe-fd": ump.UmpError,
    "no-fd": ump.UmpError,
    "two-fds": ump.UmpError,
    "garbage": ump.UmpError,
    "oversized-message": ump.UmpError,
    "dies-before-sending": EOFError,
    "silent": TimeoutError,
    "killed-mid-handshake": EOFError,
    "killed-after-sending": None,           # the memory outlives its exporter
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_hostile_peer_gets_a_clear_error_and_costs_nothing(scenario):
    """A peer process connects and lies (or dies, or says nothing): the
    importer raises what the lie calls for, maps and reserves nothing, keeps
    no descriptor, and serves the next, honest peer."""
    pool = VMMPool(emulate=True, reserve=GRAN)
    try:
        fds = _open_fds()
        with ump.share.listen(timeout=20) as listener:
            peer = start_peer(scenario, listener.address)
            try:
                with listener.accept() as conn:
                    if scenario == "silent":
                        conn.timeout = 0.5
                    if scenario == "killed-mid-handshake":
                        assert conn._sock.recv(16) == b"hello"  # it is there, then it is gone
                        peer.send_signal(signal.SIGKILL)
                    if SCENARIOS[scenario] is None:
                        with conn.recv() as handle, pool.import_handle(handle) as mem:
                            assert bytes(mem.array()[:5]) == b"ump!\0"
                    else:
                        with pytest.raises(SCENARIOS[scenario]):
                            with conn.recv() as handle:
                                pool.import_handle(handle).close()
            finally:
                peer.kill()
                peer.wait(30)
            st_ = pool.statistics()
            assert (st_.views, st_.imported_bytes, st_.reserved_bytes) == (0, 0, GRAN)
            # the same listener still serves an honest peer
            honest = start_peer("honest", listener.address)
            with listener.accept() as conn, conn.recv() as handle, pool.import_handle(handle) as mem:
                assert bytes(mem.array()[:5]) == b"ump!\0"
            assert honest.wait(30) == 0
        assert _open_fds() == fds
    finally:
        pool.close()
