"""Sharing VMM memory: between processes (export / import of handles), at two
addresses (aliases, rings) and over devices (striping), on the emulated
physical layer (memfd), so the logic runs on every machine. The same code
calls cuMemExportToShareableHandle / cuMemImportFromShareableHandle on a GPU;
that path is proven only on one (docs/pools.md, "Sharing")."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import socket
import stat
import sys

import numpy as np
import pytest

import ump
import ump.share
from _pools import emulated_pool
from ump import _core, _share
from ump._vmm import VMMPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and SCM_RIGHTS are Linux's")

MiB = 1 << 20
GRAN = 2 * MiB
CHILD_TIMEOUT = 60


def _open_fds() -> int:
    """File descriptors of this process open on ump's memory (memfds): every
    handle is one, so a leaked handle shows here. multiprocessing's own pipes
    (its resource tracker's, say) stay open across tests and are not counted."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ump-vmm")
        except OSError:
            pass  # the listing's own fd, closed by now
    return n


@pytest.fixture
def pool():
    yield from emulated_pool(1 << 30)


# --- between processes ----------------------------------------------------------

def _importer(handle, conn):
    """Child: map the parent's memory, check its data, write its own, report."""
    mem = ump.import_handle(handle)
    handle.close()
    a = mem.array()
    ok = bool((a[: 4 * MiB] == 7).all())
    a[: MiB] = 42
    conn.send(ok)
    conn.recv()  # the parent has read the child's write
    del a
    mem.close()
    conn.send(mem.pool.statistics().imported_bytes == 0)


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.filterwarnings("ignore:.*fork:DeprecationWarning")  # 3.12+: fork with threads
def test_two_processes_share_memory_both_ways(pool, method):
    """spawn: the handle is pickled (its fd duplicated into the child);
    fork: the child inherits it."""
    fds = _open_fds()
    mem = pool.allocate_shared(4 * MiB)
    a = mem.array()
    a[:] = 7
    ctx = multiprocessing.get_context(method)
    parent, child = ctx.Pipe()
    with mem.export() as handle:
        proc = ctx.Process(target=_importer, args=(handle, child))
        proc.start()
    assert parent.poll(CHILD_TIMEOUT), "the importing child did not answer"
    assert parent.recv() is True  # it read what this process wrote
    assert (a[:MiB] == 42).all() and (a[MiB:] == 7).all()  # and this one reads its write
    parent.send("done")
    assert parent.recv()
    proc.join(CHILD_TIMEOUT)
    assert proc.exitcode == 0
    proc.close()
    assert pool.statistics().exports == 1
    del a
    mem.close()
    child.close()
    parent.close()
    assert _open_fds() == fds


def _exporter(address):
    """Child: export memory over ump.share's socket, then exit first."""
    p = VMMPool(emulate=True, reserve=GRAN)
    mem = p.allocate_shared(3 * MiB)
    mem.array()[:] = np.arange(3 * MiB, dtype=np.uint32).view(np.uint8)[: 3 * MiB]
    with ump.share.connect(address) as conn, mem.export() as handle:
        conn.send(handle)
        conn._sock.recv(1)  # wait until the parent has imported
    # exits with the memory still mapped, the pool open: the kernel cleans up


def test_the_exporter_exits_first_and_the_importer_still_reads(pool):
    fds = _open_fds()
    ctx = multiprocessing.get_context("spawn")
    with ump.share.listen() as listener:
        proc = ctx.Process(target=_exporter, args=(listener.address,))
        proc.start()
        with listener.accept() as conn:
            handle = conn.recv()
            assert (handle.size, handle.nbytes, handle.emulated) == (3 * MiB, 4 * MiB, True)
            assert handle.pid == proc.pid
            mem = pool.import_handle(handle)
            handle.close()
            conn._sock.send(b"k")
        proc.join(CHILD_TIMEOUT)
    assert proc.exitcode == 0
    expected = np.arange(3 * MiB, dtype=np.uint32).view(np.uint8)[: 3 * MiB]
    a = mem.array()
    assert (a == expected).all()  # the exporter is gone; its memory is not
    a[:] = 1  # still writable
    st = pool.statistics()
    assert st.imported_bytes == 4 * MiB and st.physical_bytes == 0  # not the pool's memory
    del a
    mem.close()
    st = pool.statistics()
    assert (st.imported_bytes, st.views, st.view_bytes) == (0, 0, 0)
    assert _open_fds() == fds  # no fd left behind: the memory is gone with the last one


def test_handles_pickle_through_multiprocessing_reduction(pool):
    mem = pool.allocate_shared(GRAN)
    mem.array()[:8] = 3
    with mem.export() as handle:
        copy = pickle.loads(pickle.dumps(handle))  # the fd travels through DupFd
    assert copy.fd != handle._fd and copy.nbytes == GRAN
    with copy, pool.import_handle(copy) as other:
        assert (other.array()[:8] == 3).all()
        assert other.ptr != mem.ptr
    mem.close()


def test_bad_handles_give_clear_errors(pool, tmp_path):
    mem = pool.allocate_shared(GRAN)
    handle = mem.export()
    meta = dict(size=GRAN, nbytes=GRAN, granularity=GRAN, device=0, emulated=True)

    handle.close()
    with pytest.raises(ump.UmpError, match="export handle is closed"):
        ump.import_handle(handle, pool)

    handle = mem.export()
    os.close(handle.fd)  # closed behind the handle's back
    with pytest.raises(ump.UmpError, match="file descriptor .* is closed"):
        pool.import_handle(handle)
    handle._fd = None

    with open(tmp_path / "f", "wb") as f:
        f.write(b"\0" * GRAN)
    foreign = [os.open(tmp_path / "f", os.O_RDWR), os.memfd_create("ump-vmm-shared")]
    os.ftruncate(foreign[1], GRAN)  # the right name, but not sealed
    for fd in foreign:
        with ump.ExportHandle(fd, **meta) as h, pytest.raises(ump.UmpError, match="foreign or stale"):
            pool.import_handle(h)

    with mem.export() as good:
        stale = ump.ExportHandle(os.dup(good.fd), **{**meta, "nbytes": 2 * GRAN})
        with stale, pytest.raises(ump.UmpError, match="foreign or stale"):
            pool.import_handle(stale)  # its size does not match the memory
        odd = ump.ExportHandle(os.dup(good.fd), **{**meta, "granularity": 64 << 10})
        with odd, pytest.raises(ump.UmpError, match="granularity"):
            pool.import_handle(odd)
        gpu = ump.ExportHandle(os.dup(good.fd), **{**meta, "emulated": False})
        with gpu, pytest.raises(ump.UmpError, match="GPU pool cannot be imported into an emulated"):
            pool.import_handle(gpu)
    with pytest.raises(TypeError):
        ump.import_handle(3)
    alias_of = pool.ring(GRAN)
    with pytest.raises(ump.UmpError, match="only memory from allocate_shared"):
        alias_of.export()
    alias_of.close()
    st = pool.statistics()
    assert (st.imported_bytes, st.views) == (0, 1)
    mem.close()


def test_no_sharing_where_handles_cannot_travel(pool, monkeypatch):
    monkeypatch.setattr(_share.sys, "platform", "darwin")
    with pytest.raises(ump.UmpError, match="needs Linux"):
        pool.allocate_shared(GRAN)
    with pytest.raises(ump.UmpError, match="needs Linux"):
        ump.share.listen()


def test_shared_memory_counts_against_the_limit_and_is_never_trimmed(pool):
    pool.set_limit(4 * MiB)
    mem = pool.allocate_shared(4 * MiB)
    with pytest.raises(ump.OutOfMemoryError, match="limit"):
        pool.allocate_shared(GRAN)
    assert pool.trim() == 0 and pool.statistics().physical_bytes == 4 * MiB
    arr = mem.array()
    with pytest.raises(ump.UmpError, match="still alive"):
        mem.close()
    del arr
    mem.close()
    with pytest.raises(ump.UmpError, match="closed"):
        mem.export()
    assert pool.statistics().physical_bytes == 0


def test_views_record_how_long_each_step_took(pool):
    mem = pool.allocate_shared(2 * GRAN)
    with mem.export() as handle, pool.import_handle(handle) as imported:
        t = imported.setup_times
        assert isinstance(t, ump.ViewTimes)
        # reserved, imported (the memfd checked and duplicated) and mapped
        assert t.reserve_ns > 0 and t.physical_ns > 0 and t.map_ns > 0
    assert mem.setup_times.physical_ns > 0  # created
    blk = pool.allocate(GRAN)
    with pool.alias(blk, GRAN) as alias:
        assert alias.setup_times.physical_ns == 0  # an alias creates no memory, it maps the block's
        assert alias.setup_times.map_ns > 0
    pool.deallocate(blk)
    mem.close()


# --- the sockets handles travel over ----------------------------------------------

def test_the_socket_is_private():
    with ump.share.listen() as listener:
        sock = os.stat(listener.address)
        folder = os.stat(os.path.dirname(listener.address))
        assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    assert not os.path.exists(os.path.dirname(listener.address))


def test_a_socket_in_a_shared_directory_is_refused(tmp_path):
    os.chmod(tmp_path, 0o755)
    with pytest.raises(PermissionError, match="mode 0755"):
        ump.share.listen(str(tmp_path / "s"))
    os.chmod(tmp_path, 0o700)
    with ump.share.listen(str(tmp_path / "s")) as listener:
        assert listener.address == str(tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_a_peer_of_another_user_is_refused(monkeypatch, pool):
    with ump.share.listen() as listener:
        with ump.share.connect(listener.address) as ours:
            with listener.accept() as conn, pool.allocate_shared(GRAN) as mem, mem.export() as h:
                ours.send(h)
                with conn.recv() as got:
                    assert got.nbytes == GRAN
        # SO_PEERCRED reports this process's uid; make it look like another's.
        monkeypatch.setattr(_share, "_own_uid", lambda: os.getuid() + 1)
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stranger.connect(listener.address)
        with pytest.raises(PermissionError, match=f"refused a connection from uid {os.getuid()}"):
            listener.accept()
        assert stranger.recv(1) == b""  # and its connection was closed
        stranger.close()
        with pytest.raises(PermissionError, match="refused"):
            ump.share.connect(listener.address)  # the client checks the listener too


# --- two addresses for one memory -------------------------------------------------

def test_ring_halves_alias_and_a_read_across_the_end_is_contiguous(pool):
    with pytest.raises(ValueError, match="multiple of the pool's granularity"):
        pool.ring(MiB)
    ring = pool.ring(2 * GRAN)
    n = ring.size
    assert ring.nbytes == 2 * n and pool.statistics().shared_bytes == n  # one copy of the memory
    a = ring.array()
    a[:n] = np.arange(n, dtype=np.uint64).astype(np.uint8)
    assert (a[n:] == a[:n]).all()  # written through the first half, read through the second
    a[n + 5] = 99
    assert a[5] == 99  # and the other way
    tail = ctypes.string_at(ring.ptr + n - 4, 8)  # one read across the end
    assert tail == bytes(a[n - 4:n]) + bytes(a[:4])
    del a
    ring.close()


def test_an_alias_sees_writes_and_pins_the_block_in_place(pool):
    blk = pool.allocate(5 * MiB)
    ctypes.memset(blk, 1, 5 * MiB)
    alias = pool.alias(blk + MiB, 3 * MiB)
    assert alias.ptr != blk + MiB
    ctypes.memset(blk + MiB, 2, 16)
    assert ctypes.string_at(alias.ptr, 17) == b"\x02" * 16 + b"\x01"
    ctypes.memset(alias.ptr + 3 * MiB - 1, 3, 1)
    assert ctypes.string_at(blk + 4 * MiB - 1, 1) == b"\x03"
    assert ump.kind_of(alias.ptr) == "host"
    with pytest.raises(ump.UmpError):
        pool.migrate(blk, 5 * MiB, 1)  # the alias would keep the old memory
    with pytest.raises(ValueError, match="not inside one live block"):
        pool.alias(blk + 4 * MiB, 2 * MiB)
    alias.close()
    pool.migrate(blk, 5 * MiB, 1)  # free to move again
    pool.deallocate(blk)


def test_an_aliased_chunk_is_not_scavenged(pool):
    blk = pool.allocate(GRAN)
    alias = pool.alias(blk, GRAN)
    before = pool.statistics()
    assert before.idle_bytes == 0
    ctypes.memset(blk, 4, GRAN)
    pool.deallocate(blk)  # the alias holds the chunk; trim must not unmap it
    pool.trim()
    assert ctypes.string_at(alias.ptr, 4) == b"\x04" * 4
    assert pool.statistics().physical_bytes == GRAN
    alias.close()
    pool.trim()
    assert pool.statistics().physical_bytes == 0


def test_striped_granules_alternate_between_devices(pool):
    mem = pool.striped(5 * GRAN, [0, 1, 2])
    assert [mem.device_of(g * GRAN) for g in range(5)] == [0, 1, 2, 0, 1]
    assert mem.device_of(0, 2 * GRAN) == -1  # mixed
    assert set(pool.devices) == {0, 1, 2}
    a = mem.array()
    a[:] = 5  # one contiguous range over all of them
    assert (a == 5).all() and pool.statistics().handles == 5
    del a
    mem.close()
    assert pool.statistics().physical_bytes == 0


@pytest.mark.parametrize("make", ["shared", "ring", "striped", "alias"])
def test_a_view_failing_half_way_leaks_nothing(pool, make):
    blk = pool.allocate(4 * MiB)
    before = pool.statistics()
    fds = _open_fds()
    for after in range(8):
        _core.fault_inject(after, 1)
        try:
            mem = {"shared": lambda: pool.allocate_shared(3 * GRAN),
                   "ring": lambda: pool.ring(GRAN),
                   "striped": lambda: pool.striped(3 * GRAN, [0, 1]),
                   "alias": lambda: pool.alias(blk, 4 * MiB)}[make]()
        except ump.UmpError as err:
            assert "UMP_ERR_INJECTED" in str(err)
        else:
            _core.fault_inject(0, 0)
            mem.close()
            break
        finally:
            _core.fault_inject(0, 0)
        st = pool.statistics()
        assert (st.views, st.view_bytes, st.shared_bytes, st.physical_bytes, st.reserved_bytes) == (
            0, 0, 0, before.physical_bytes, before.reserved_bytes)
        assert _open_fds() == fds
    else:
        pytest.fail("every attempt failed")
    assert st.rollbacks > before.rollbacks
    pool.deallocate(blk)


# --- what a peer sends is checked before anything is mapped ---------------------

def test_a_handle_claiming_more_than_its_memory_is_refused(pool):
    """The import maps nbytes (checked against the memfd) but its arrays span
    size: a size past nbytes would write beyond the mapping, into whatever
    lies behind it."""
    mem = pool.allocate_shared(GRAN)
    meta = dict(granularity=GRAN, device=0, emulated=True)
    with mem.export() as good:
        for size in (2 * GRAN, GRAN + 1, 0, -1):
            bad = ump.ExportHandle(os.dup(good.fd), size=size, nbytes=GRAN, **meta)
            with bad, pytest.raises(ump.UmpError, match=rf"size \({size} bytes\).*\({GRAN} bytes\)"):
                pool.import_handle(bad)
        st = pool.statistics()
        assert (st.views, st.imported_bytes) == (1, 0)  # nothing was mapped
        with ump.ExportHandle(os.dup(good.fd), size=GRAN - 1, nbytes=GRAN, **meta) as fits, \
                pool.import_handle(fits) as other:
            assert other.nbytes == GRAN - 1 and other.array().nbytes == GRAN - 1
    mem.close()


def _memfds(name: str) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}")
        except OSError:
            pass
    return n


@pytest.mark.parametrize("msg", [b"[]", b"3", b"null", b'"handle"', b"[" * 3000,
                                 b'{"size": Infinity, "nbytes": 1, "granularity": 1, "device": 0, '
                                 b'"emulated": true, "pid": 1}',
                                 b'{"size": 1, "nbytes": 1, "granularity": 1, "device": 0, '
                                 b'"emulated": true, "pid": 1, "event": 5}'])
def test_a_malformed_description_is_refused_and_its_descriptor_closed(msg):
    """Valid JSON that is not a handle's description (not an object, a size
    of Infinity, an event that is not hex, nesting too deep to parse): an
    UmpError, and the file descriptor that came with it is closed."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("ump-test-received")
    with ump.share.Connection(a) as sender, ump.share.Connection(b) as receiver:
        socket.send_fds(sender._sock, [msg], [fd])
        os.close(fd)  # the one in flight is the receiver's to close
        with pytest.raises(ump.UmpError, match="malformed export handle"):
            receiver.recv()
        assert _memfds("ump-test-received") == 0


def _import_in_fork(handle, conn):
    mem = ump.import_handle(handle)
    handle.close()
    conn.send(bool((mem.array()[:4] == 9).all()))
    mem.close()


@pytest.mark.filterwarnings("ignore:.*fork:DeprecationWarning")  # 3.12+: fork with threads
def test_a_forked_child_imports_through_a_pool_of_its_own(pool):
    """The parent's importing pool is inherited by a forked child, which must
    not map into it (its handles are the parent's); the child's import makes a
    pool of its own."""
    mem = pool.allocate_shared(GRAN)
    mem.array()[:] = 9
    with mem.export() as handle:
        ump.import_handle(handle).close()  # the parent now has an importing pool
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_import_in_fork, args=(handle, child))
        proc.start()
        assert parent.poll(CHILD_TIMEOUT), "the forked child did not answer"
        assert parent.recv() is True
        proc.join(CHILD_TIMEOUT)
    assert proc.exitcode == 0
    proc.close()
    parent.close()
    child.close()
    mem.close()


def test_device_of_a_view_stays_inside_it(pool):
    ring = pool.ring(GRAN)
    assert ring.device_of(0, 2 * GRAN) == 0 and ring.device_of(2 * GRAN - 1) == 0
    for offset, size in ((2 * GRAN, 1), (GRAN, GRAN + 1), (-1, 1), (0, 0), (0, -1)):
        with pytest.raises(ValueError):
            ring.device_of(offset, size)
    ring.close()
