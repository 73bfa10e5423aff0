"""A peer process for the hostile-peer tests: connects to a ump.share
listener and does what its scenario says (python _hostile_peer.py SCENARIO
ADDRESS). Every scenario but "honest" lies, goes silent or dies; the
listening test checks the importer's answer. With --gpu the memory is a GPU
pool's (test_gpu_hostile_peer.py); otherwise an emulated pool's."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import ump
import ump.share

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def start(scenario: str, address: str, gpu: bool = False) -> subprocess.Popen:
    """This script as a peer process that connects to ``address``."""
    path = os.pathsep.join(filter(None, (HERE, os.environ.get("PYTHONPATH"))))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "_hostile_peer.py"), scenario, address,
                             *(["--gpu"] if gpu else [])], env={**os.environ, "PYTHONPATH": path})


def _memory(gpu: bool):
    """2 MiB of shareable memory that starts with b"ump!\\0", and its pool."""
    if gpu:
        import numpy

        from ump._cupy_compat import import_cupy

        cp = import_cupy()
        pool = ump.VMMPool(0)
        mem = pool.allocate_shared(2 * MiB)
        mem.array((8,), "uint8")[:] = cp.asarray(numpy.frombuffer(b"ump!\0\0\0\0", numpy.uint8))
        cp.cuda.runtime.deviceSynchronize()
    else:
        pool = ump.VMMPool(emulate=True, reserve=2 * MiB)
        mem = pool.allocate_shared(2 * MiB)
        mem.array()[:5] = list(b"ump!\0")
    return pool, mem


def _send(sock, meta, fds):
    msg = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    socket.send_fds(sock, [msg], fds)


def main(scenario: str, address: str, gpu: bool) -> None:
    pool, mem = _memory(gpu)
    handle = mem.export()
    meta = handle._meta()
    conn = ump.share.connect(address, timeout=60)
    sock = conn._sock
    lies = {
        "size-past-memory": {**meta, "size": 64 * MiB},
        "nbytes-past-2-64": {**meta, "size": 64 * MiB, "nbytes": 2**64 + meta["nbytes"]},
        "nbytes-past-memory": {**meta, "nbytes": 2 * meta["nbytes"]},
        "granularity-2-46": {**meta, "granularity": 2**46, "nbytes": 2**46},
    }
    if scenario == "honest":
        conn.send(handle)
    elif scenario in lies:
        _send(sock, lies[scenario], [handle.fd])
    elif scenario == "foreign-fd":
        fd = os.open(os.devnull, os.O_RDWR)
        _send(sock, meta, [fd])
    elif scenario == "unsealed-memfd":
        fd = os.memfd_create("ump-vmm-shared")
        os.ftruncate(fd, meta["nbytes"])
        _send(sock, meta, [fd])
    elif scenario == "pipe-fd":
        r, _w = os.pipe()
        _send(sock, meta, [r])
    elif scenario == "no-fd":
        _send(sock, meta, [])
    elif scenario == "two-fds":
        _send(sock, meta, [handle.fd, handle.fd])
    elif scenario == "garbage":
        _send(sock, b'{"size": "all of it", "nbytes": [1]}', [handle.fd])
    elif scenario == "oversized-message":
        _send(sock, {**meta, "pad": "x" * 8192}, [handle.fd])
    elif scenario == "dies-before-sending":
        os._exit(0)
    elif scenario == "silent":
        time.sleep(600)  # the test gives up on it, then kills it
    elif scenario == "killed-mid-handshake":
        sock.send(b"hello")
        time.sleep(600)  # killed here, with the connection open
    elif scenario == "killed-after-sending":
        conn.send(handle)
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of its pool or context
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    # Until the listener has read it: a peer that exits at once is also fine
    # (the descriptor in flight keeps the memory), but this one waits.
    sock.settimeout(30)
    try:
        sock.recv(1)
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    main(args[0], args[1], "--gpu" in sys.argv)
