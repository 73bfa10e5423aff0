"""Hostile peers against the real driver: handles that lie about their
sizes, descriptors that are closed or not CUDA's, exporters that die
mid-handshake. The emulated layer's answers are in test_fuzz.py and
test_hostile_input.py; here cuMemImportFromShareableHandle and cuMemMap
give them. Every case must end in a clear exception (or, for memory whose
exporter died after sending it, a working import), never a fault, and leave
no descriptor, mapping or reservation behind.

Run with CUPY_ENABLE_UMP=1 on a CUDA machine; skipped elsewhere. Each
allocation is 2 MiB (one granule).
"""

from __future__ import annotations

import os
import signal
import socket

import pytest

import ump
import ump.share
from _hostile_peer import start

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def cupy(vmm_cupy):
    return vmm_cupy


@pytest.fixture
def pool(cupy):
    from ump import _driver

    if not _driver.exports_fds(0):
        pytest.skip("device 0 cannot export memory as a file descriptor")
    p = ump.VMMPool(0, limit=64 * MiB)
    if not p.statistics().granularity:
        p.close()
        pytest.skip("the driver reports no VMM granularity")
    yield p
    cupy.cuda.runtime.deviceSynchronize()
    st = p.statistics()
    assert (st.views, st.imported_bytes) == (0, 0), "a view was left open"
    p.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _untouched(pool) -> tuple:
    st = pool.statistics()
    return st.views, st.imported_bytes, st.reserved_bytes, st.view_bytes


def _read(cupy, mem) -> bytes:
    return bytes(cupy.asnumpy(mem.array((8,), "uint8"))[:5])


# What the importer must raise for each scenario of _hostile_peer.py; None:
# the import works and reads the exporter's data.
SCENARIOS = {
    "size-past-memory": ump.UmpError,       # refused before the driver is asked
    "nbytes-past-2-64": ValueError,         # refused before the driver is asked
    "nbytes-past-memory": ump.UmpError,     # the driver maps less than described: cuMemMap fails
    "granularity-2-46": ump.UmpError,
    "foreign-fd": ump.UmpError,             # /dev/null: not a CUDA handle
    "unsealed-memfd": ump.UmpError,         # a memfd: not a CUDA handle
    "pipe-fd": ump.UmpError,
    "no-fd": ump.UmpError,
    "two-fds": ump.UmpError,
    "garbage": ump.UmpError,
    "dies-before-sending": EOFError,
    "killed-mid-handshake": EOFError,
    "killed-after-sending": None,
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_hostile_exporter_process(cupy, pool, scenario):
    """A GPU exporter in another process lies, dies or sends what is not
    CUDA's memory: the importer raises, maps nothing, keeps no descriptor,
    and its pool and listener serve an honest exporter next."""
    before = _untouched(pool)
    fds = _open_fds()
    with ump.share.listen(timeout=120) as listener:
        peer = start(scenario, listener.address, gpu=True)
        try:
            with listener.accept() as conn:
                if scenario == "killed-mid-handshake":
                    assert conn._sock.recv(16) == b"hello"
                    peer.send_signal(signal.SIGKILL)
                    peer.wait(60)
                if scenario == "killed-after-sending":
                    handle = conn.recv()
                    peer.wait(60)  # it killed itself: no clean-up of its pool or context
                    assert peer.returncode == -signal.SIGKILL
                    with handle, pool.import_handle(handle) as mem:
                        assert _read(cupy, mem) == b"ump!\0"
                else:
                    with pytest.raises(SCENARIOS[scenario]) as err:
                        with conn.recv() as handle:
                            pool.import_handle(handle).close()
                    assert str(err.value)  # says what was wrong
        finally:
            peer.kill()
            peer.wait(60)
        cupy.cuda.runtime.deviceSynchronize()
        assert _untouched(pool) == before
        honest = start("honest", listener.address, gpu=True)
        with listener.accept() as conn, conn.recv() as handle, pool.import_handle(handle) as mem:
            assert _read(cupy, mem) == b"ump!\0"
        assert honest.wait(120) == 0
    assert _open_fds() == fds


def test_closed_and_foreign_descriptors_in_process(cupy, pool):
    """Descriptors that name nothing, or something that is not CUDA's
    memory, handed to the driver's import: clear errors, no fault, no fd
    left behind."""
    g = pool.granularity
    fields = dict(size=g, nbytes=g, granularity=g, device=0, emulated=False)
    fds = _open_fds()
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    stale = ump.ExportHandle(closed, **fields)
    with pytest.raises(ump.UmpError, match="closed"):
        pool.import_handle(stale)
    stale._fd = None  # its number may name another descriptor by the time it is collected
    a, b = socket.socketpair()
    r, w = os.pipe()
    memfd = os.memfd_create("ump-vmm-shared")
    os.ftruncate(memfd, g)
    for fd in (os.open(os.devnull, os.O_RDWR), a.detach(), r, memfd):
        with ump.ExportHandle(fd, **fields) as h, pytest.raises(ump.UmpError):
            pool.import_handle(h)
    b.close()
    os.close(w)
    assert _untouched(pool)[:2] == (0, 0)
    assert _open_fds() == fds


def test_lying_sizes_are_refused_before_the_driver_is_asked(cupy, pool):
    """Sizes past 2**64, past the memory behind the handle or past any GPU:
    refused with the field named, nothing reserved, on the real driver path
    (the checks do not depend on the emulation)."""
    g = pool.granularity
    fd = os.open(os.devnull, os.O_RDONLY)  # never reached: the description is refused first
    largest = max(d.total_memory for d in ump.probe().devices)
    cases = [(dict(size=64 * MiB, nbytes=2**64 + g), r"nbytes \(\d+\) must be an integer"),
             (dict(size=2 * g, nbytes=g), r"size \(\d+ bytes\) must be positive and at most"),
             (dict(size=g, nbytes=(largest // g + 1) * g), "more than any GPU here has"),
             (dict(size=g, nbytes=g, device=2**32), r"device \(4294967296\)")]
    before = _untouched(pool)
    for lie, match in cases:
        fields = {**dict(size=g, nbytes=g, granularity=g, device=0, emulated=False), **lie}
        with ump.ExportHandle(os.dup(fd), **fields) as h, pytest.raises(ValueError, match=match):
            pool.import_handle(h)
    os.close(fd)
    assert _untouched(pool) == before
