"""Hostile input through the public API: sizes, addresses and device indices
past what a C integer holds, peers that lie about what they send, and the
call orders and limits that used to crash, leak or reach past a mapping.
Each test fails without the fix it names; all run without a GPU (the
emulated pool, the host backend). The random counterpart is test_fuzz.py;
the GPU's is test_gpu_hostile_peer.py."""

from __future__ import annotations

import ctypes
import os
import pickle
import resource
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import ump
import ump.share
from _fork import fork, wait
from _pools import emulated_pool
from ump import _core, _vmm
from ump._vmm import VMMPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and SCM_RIGHTS are Linux's")

MiB = 1 << 20
GRAN = 2 * MiB


@pytest.fixture
def pool():
    yield from emulated_pool(1 << 30)


def _meta(**fields):
    return {"size": GRAN, "nbytes": GRAN, "granularity": GRAN, "device": 0, "emulated": True, **fields}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status(field: str) -> int:
    """A figure of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


# --- 1. a peer's sizes pass 2**64 ---------------------------------------------------

@pytest.mark.parametrize("route", ["direct", "pickled"])
def test_a_handle_claiming_nbytes_past_2_64_is_refused(pool, route):
    """4 MiB of real memory described as nbytes = 2**64 + 4 MiB, size = 64 MiB:
    ctypes kept the low 64 bits (4 MiB, which the memfd matched) while Python
    compared the full number, so the import succeeded and its arrays spanned
    64 MiB of a 4 MiB mapping. The description arrives the same way through
    multiprocessing's pickling."""
    mem = pool.allocate_shared(4 * MiB)
    with mem.export() as good:
        liar = ump.ExportHandle(os.dup(good.fd), **_meta(size=64 * MiB, nbytes=2**64 + 4 * MiB))
        if route == "pickled":
            liar = pickle.loads(pickle.dumps(liar))  # the fd through DupFd, the numbers as sent
        with liar, pytest.raises(ValueError, match="nbytes"):
            pool.import_handle(liar)
    st = pool.statistics()
    assert (st.views, st.imported_bytes) == (1, 0)  # nothing mapped, nothing reserved
    mem.close()


# --- 2. sizes, addresses and devices past what C holds ------------------------------

BIG = 2**64


def test_pool_sizes_past_2_64_are_refused_not_truncated(pool):
    """allocate(2**64 + 512) used to return a 512-byte block, deallocate(p +
    2**64) to free p, and ring/allocate_shared/alias to map far less than
    they reported."""
    with pytest.raises(ValueError, match=rf"size must be .*got {BIG + 512}"):
        pool.allocate(BIG + 512)
    p = pool.allocate(GRAN)
    with pytest.raises(ValueError, match=rf"ptr must be .*got {p + BIG}"):
        pool.deallocate(p + BIG)
    assert pool.statistics().current_count == 1  # p is still live
    for make in (lambda: pool.ring(BIG + GRAN), lambda: pool.allocate_shared(BIG + GRAN),
                 lambda: pool.alias(p, BIG + 512), lambda: pool.alias(p + BIG, 512),
                 lambda: pool.striped(BIG + GRAN, [0]), lambda: pool.buffer(BIG + GRAN),
                 lambda: pool.device_of(p, BIG + 1), lambda: pool.migrate(p, BIG + 512, 1)):
        with pytest.raises(ValueError, match=r"must be an integer from 0 to 2\*\*64 - 1, got 18446\d{15}"):
            make()
    assert pool.statistics().views == 0
    pool.deallocate(p)


def test_device_indices_past_a_c_int_are_refused():
    """VMMPool(2**32, emulate=True) was a pool on device 0."""
    with pytest.raises(ValueError, match=r"device must be .*got 4294967296"):
        VMMPool(2**32, emulate=True, reserve=GRAN)
    p = VMMPool(emulate=True, reserve=GRAN)
    try:
        for call in (lambda: p.grant(2**32), lambda: p.striped(GRAN, [2**32 + 1])):
            with pytest.raises(ValueError, match=r"device must be .*got 42949672\d\d"):
                call()
        assert p.devices == (0,)
    finally:
        p.close()


def test_every_c_function_checks_its_integers_in_one_place():
    """The binding refuses, naming the parameter, any integer its C type
    cannot hold, whichever function is called: none reaches C truncated."""
    checked = [fn for fn in vars(_core).values() if callable(fn) and hasattr(fn, "params")]
    assert len(checked) > 40
    for fn in checked:
        for i, p in enumerate(fn.params):
            if p.lo is None:
                continue
            args = [q.lo if q.lo is not None else None for q in fn.params]
            for bad in (p.lo - 1, p.hi + 1):
                args[i] = bad
                with pytest.raises(ValueError, match=rf"{fn.__name__}: {p.name} must be .*got {bad}$"):
                    fn(*args)


# --- 3. an id and a status in one integer -------------------------------------------

@pytest.mark.parametrize("status", ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE"])
def test_a_driver_error_is_never_taken_for_an_id(pool, status):
    """The view makers returned a view id or a status in one int; Python
    checked only < 0, so the driver's out-of-memory (2) read as view 2: a
    MappedMemory over another view, whose close() destroyed that one. The
    driver's answer is injected where cuMemCreate would give it."""
    others = [pool.ring(GRAN) for _ in range(3)]  # views 0, 1, 2
    for make in (lambda: pool.allocate_shared(4 * GRAN), lambda: pool.ring(GRAN),
                 lambda: pool.striped(2 * GRAN, [0, 1])):
        _core.fault_status(getattr(_core, status))
        _core.fault_inject(0, 1)
        with pytest.raises(ump.UmpError) as err:
            make()
        _core.fault_inject(0, 0)
        assert err.value.cuda_error == status
        assert isinstance(err.value, ump.OutOfMemoryError) == (status == "CUDA_ERROR_OUT_OF_MEMORY")
    assert pool.statistics().views == 3
    for ring in others:
        a = ring.array()
        a[GRAN] = 5
        assert a[0] == 5  # each other view still maps its own memory
        del a
        ring.close()


# --- 4. a forked child collects the parent's listener -------------------------------

@pytest.mark.filterwarnings("ignore:.*fork:DeprecationWarning")
def test_a_forked_child_leaves_the_parents_socket_alone(pool):
    with ump.share.listen(timeout=10) as listener:
        pid = fork()
        if pid == 0:
            try:
                listener.close()  # as __del__ does when the child collects its copy
            finally:
                os._exit(0)
        assert wait(pid) == 0
        assert os.path.exists(listener.address)
        with ump.share.connect(listener.address, timeout=10) as client, listener.accept() as conn, \
                pool.allocate_shared(GRAN) as mem, mem.export() as handle:
            client.send(handle)
            with conn.recv() as got:
                assert got.nbytes == GRAN
    assert not os.path.exists(os.path.dirname(listener.address))  # its maker removes it


# --- 5. received descriptors leak into programs this process runs -------------------

def _reaches_a_child(fd: int) -> bool:
    """Whether a program run with close_fds=False gets ``fd``."""
    code = f"import os, sys\ntry:\n    os.fstat({fd})\nexcept OSError:\n    sys.exit(1)\n"
    return subprocess.run([sys.executable, "-c", code], close_fds=False, timeout=60).returncode == 0


@pytest.mark.parametrize("route", ["socket", "pickled"])
def test_received_descriptors_are_close_on_exec(pool, route):
    """CPython's socket.recv_fds (and multiprocessing's recvfds) ignore
    MSG_CMSG_CLOEXEC: a received handle passed the shared memory to every
    program exec'd, posix_spawn'ed or system()'d afterwards."""
    with pool.allocate_shared(GRAN) as mem, mem.export() as handle:
        if route == "socket":
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with ump.share.Connection(a) as sender, ump.share.Connection(b) as receiver:
                sender.send(handle)
                got = receiver.recv()
        else:
            got = pickle.loads(pickle.dumps(handle))
        with got:
            assert not os.get_inheritable(got.fd)
            assert not _reaches_a_child(got.fd)
        assert not os.get_inheritable(handle.fd)  # an exported one neither


# --- 6. work done before a handle is checked ----------------------------------------

def test_a_lying_granularity_reserves_nothing(pool, monkeypatch):
    """The default importing pool used to be made with the handle's
    granularity as its reservation: granularity = 2**46 left 64 TiB of
    address space reserved and a 256 MiB granule map resident for good."""
    monkeypatch.setattr(_vmm, "_importers", {})
    with pool.allocate_shared(GRAN) as mem, mem.export() as good:
        vm = _status("VmSize")
        liar = ump.ExportHandle(os.dup(good.fd), **_meta(granularity=2**46, nbytes=2**46, size=GRAN))
        with liar, pytest.raises(ump.UmpError):
            ump.import_handle(liar)
        assert _status("VmSize") - vm < 256 * MiB
        assert _vmm._importers == {}  # no pool was made for it
        with ump.ExportHandle(os.dup(good.fd), **_meta()) as honest, ump.import_handle(honest) as m:
            assert m.pool.statistics().reserved_bytes == 2 * GRAN  # one granule + the view's
        _vmm._importers.popitem()[1].close()


def test_a_lying_size_is_checked_against_the_descriptor_before_any_allocation(pool):
    """nbytes = 2**47 for a 2 MiB memfd: the import allocated (and filled) a
    512 MiB granule map before it looked at the descriptor."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident size (VmHWM)
    except OSError as err:
        pytest.skip(f"cannot reset the peak resident size here: {err}")
    with pool.allocate_shared(GRAN) as mem, mem.export() as good:
        liar = ump.ExportHandle(os.dup(good.fd), **_meta(nbytes=2**47))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss = _rss()
        with liar, pytest.raises(ump.UmpError, match="foreign or stale"):
            pool.import_handle(liar)
        assert _status("VmHWM") - rss < 128 * MiB


# --- 7. np.zeros past the cap -------------------------------------------------------

def test_zeros_past_the_cap_commit_no_memory(caps):
    """Past the cap NumPy's calloc got posix_memalign + memset: np.zeros of
    512 MiB took half a second and 512 MiB resident, where NumPy's own
    allocator takes neither."""
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")
    with ump.enabled("host", cap=64 * MiB):
        before = _core.fallback_statistics()
        rss = _rss()
        t0 = time.perf_counter()
        a = np.zeros(512 * MiB, np.uint8)
        took = time.perf_counter() - t0
        assert ump.kind_of(a) is None  # past the cap: plain memory
        assert _core.fallback_statistics().current_count == before.current_count + 1
        assert a.ctypes.data % 512 == 0
        assert _rss() - rss < 32 * MiB and took < 0.1
        a[::4096] = 1  # every page written: now it is resident
        assert int(a.sum()) == 512 * MiB // 4096
        a.resize(600 * MiB, refcheck=False)  # realloc out of it keeps the data
        assert a[4096] == 1 and a[-1] == 0
        del a
        assert _core.fallback_statistics().current_count == before.current_count
        assert _rss() - rss < 32 * MiB  # and given back


# --- 8. one bin per stream, for ever ------------------------------------------------

def test_many_streams_keep_the_cost_of_an_allocation_flat(pool):
    """Each stream that freed a block kept a set of bins, searched linearly:
    7.8 us per allocate + free at first, 388 us after 100k streams. At most
    64 streams keep free blocks apart now; past that the pool waits for its
    devices and gives every free block to the next stream."""
    def per_op(streams):
        t0 = time.perf_counter()
        for s in streams:
            pool.deallocate(pool.allocate(512, stream=s))
        return (time.perf_counter() - t0) / len(streams)

    first = min(per_op(range(1 + 1000 * k, 1001 + 1000 * k)) for k in range(3))
    per_op(range(3001, 30_001))
    assert pool.statistics().stream_bins <= 64
    last = min(per_op(range(30_001 + 1000 * k, 31_001 + 1000 * k)) for k in range(3))
    assert last < 3 * first, (first, last)
    stream0 = min(per_op([0] * 1000) for _ in range(3))
    assert stream0 < 3 * first, (first, stream0)
    assert pool.statistics().used_bytes == 0


# --- 9. the smaller ones ------------------------------------------------------------

def test_a_silent_peer_times_out_with_a_clear_error():
    with ump.share.listen(timeout=0.3) as listener:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no process connected .* within 0.3 s"):
            listener.accept()
        with ump.share.connect(listener.address, timeout=0.3) as silent, listener.accept() as conn:
            with pytest.raises(TimeoutError, match="the peer sent no handle within 0.3 s"):
                conn.recv()
            with pytest.raises(TimeoutError, match="the peer sent no handle"):
                silent.recv()
        assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="timeout"):
        ump.share.listen(timeout=0)


@pytest.mark.filterwarnings("ignore:.*fork:DeprecationWarning")
def test_running_out_of_descriptors_is_that_os_error():
    """memfd_create failing with EMFILE was reported as out of memory."""
    pid = fork()
    if pid == 0:
        code = 99
        try:
            pool = VMMPool(emulate=True, reserve=GRAN)  # the child's own
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
            held = []
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            try:
                pool.allocate_shared(GRAN)
            except ump.OutOfMemoryError:
                code = 1
            except OSError as err:
                code = 0 if err.errno == 24 and "Too many open files" in str(err) else 2
            else:
                code = 3
        finally:
            os._exit(code)
    assert wait(pid) == 0


def test_lowering_the_limit_gives_back_what_no_block_uses(pool):
    """set_limit released memory only on a GPU (it asked whether CUDA was
    loaded); the emulated pool kept it, so that branch ran in no CPU test."""
    ptrs = [pool.allocate(GRAN) for _ in range(8)]
    keep = ptrs.pop()
    for p in ptrs:
        pool.deallocate(p)
    assert pool.statistics().physical_bytes == 16 * MiB  # idle, still mapped
    pool.set_limit(4 * MiB)
    st = pool.statistics()
    assert st.physical_bytes <= 4 * MiB and st.limit_bytes == 4 * MiB
    ctypes.memset(keep, 3, GRAN)  # the live block kept its memory
    pool.deallocate(keep)
    pool.set_limit()


@pytest.mark.parametrize("shape", [(2**62, 4), (2**32, 2**32), (2**61, 2**3, 1)])
def test_an_array_shape_whose_size_wraps_int64_is_refused(pool, shape):
    """MappedMemory.array multiplied the shape in int64: 2**62 x 4 read as 0
    bytes, which fits anywhere (on a GPU, a CuPy array over 0 bytes of a
    shape that spans 2**64)."""
    with pool.ring(GRAN) as ring:
        with pytest.raises(ValueError, match="does not fit"):
            ring.array(shape, "uint8")
        with pytest.raises(ValueError, match="non-negative"):
            ring.array((-1, 4), "uint8")
        assert ring.array((2, GRAN), "uint8").nbytes == 2 * GRAN
