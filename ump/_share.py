"""Sharing VMM memory between processes of one host.

A handle is a file descriptor (a sealed memfd on the emulated pool; on a GPU
the POSIX fd from ``cuMemExportToShareableHandle``) plus what an importer
needs to map it. File descriptors travel only over Unix sockets (SCM_RIGHTS):
through ``multiprocessing`` (pickling an :class:`ExportHandle` duplicates its
fd with ``multiprocessing.reduction.DupFd``) or through :func:`listen` /
:func:`connect`, whose socket only its owner may open and which refuse peers
of another user. Nothing is ever written to a path others can read.

Every peer is input: a received description is checked field by field, and
its descriptor against it, before anything is reserved for it; received
descriptors are close-on-exec; a silent peer times out.
"""

from __future__ import annotations

import array
import json
import os
import socket
import stat
import struct
import sys
import tempfile

from ._errors import InvalidArgumentError, UmpError
from ._resource import Resource

__all__ = ["ExportHandle", "listen", "connect", "Listener", "Connection", "check_platform"]

#: Seconds a sharing socket waits for a peer (accept, connect, send, recv)
#: before raising TimeoutError; None waits for ever.
DEFAULT_TIMEOUT = 60.0

#: An inter-process CUDA event handle (CUipcEventHandle) is 64 bytes.
EVENT_BYTES = 64


def check_platform() -> None:
    """Raise :class:`UmpError` where handles cannot be passed between processes."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        raise UmpError("sharing memory between processes needs Linux (memfd, and file "
                       "descriptors passed over Unix sockets)")


class ExportHandle(Resource):
    """Physical memory exported by :meth:`MappedMemory.export`, for
    :func:`import_handle` in another process (or this one).

    It owns one file descriptor: :meth:`close` it (or let it be collected)
    once imported; the importer's mapping keeps the memory alive. It pickles
    through ``multiprocessing`` (a ``Queue``, a ``Pipe``, a ``Process``'s
    arguments): the file descriptor is duplicated into the receiver over a
    Unix socket, never written anywhere.

    Attributes
    ----------
    size : int
        Bytes the exporter asked for.
    nbytes : int
        Bytes of physical memory behind the handle (whole granules).
    granularity, device : int
        The exporting pool's granularity and device.
    emulated : bool
        Exported by an emulated pool (a memfd, no GPU).
    pid : int
        The exporting process.
    event : bytes or None
        An inter-process CUDA event handle the importer's stream waits for.
    """

    def __init__(self, fd: int, *, size: int, nbytes: int, granularity: int, device: int,
                 emulated: bool, pid: int | None = None, event: bytes | None = None):
        self._fd = fd
        self.size = size
        self.nbytes = nbytes
        self.granularity = granularity
        self.device = device
        self.emulated = emulated
        self.pid = os.getpid() if pid is None else pid
        self.event = event

    def _meta(self) -> dict:
        return {"size": self.size, "nbytes": self.nbytes, "granularity": self.granularity,
                "device": self.device, "emulated": self.emulated, "pid": self.pid,
                "event": self.event.hex() if self.event is not None else None}

    @classmethod
    def _from_meta(cls, fd: int, meta) -> "ExportHandle":
        """A handle owning ``fd`` from a peer's description (a Connection's,
        or multiprocessing's); on any error the fd is closed and UmpError
        raised. Integers must arrive as integers: a peer's 1.5 or "12" is
        not quietly made into a size."""
        try:
            # Received descriptors are inheritable (multiprocessing's
            # recvfds, like socket.recv_fds, ignores flags): every program
            # this process runs would get the memory.
            os.set_inheritable(fd, False)
            if not isinstance(meta, dict):
                raise TypeError(f"expected a JSON object, got {type(meta).__name__}")
            fields = {name: meta[name] for name in ("size", "nbytes", "granularity", "device", "pid")}
            for name, value in fields.items():
                if type(value) is not int:
                    raise TypeError(f"{name} must be an integer, got {value!r}")
            if type(meta["emulated"]) is not bool:
                raise TypeError(f"emulated must be true or false, got {meta['emulated']!r}")
            event = meta.get("event")
            if event is not None and (type(event) is not str or len(event) != 2 * EVENT_BYTES):
                raise ValueError(f"event must be {EVENT_BYTES} bytes in hex, got {event!r}")
            fields.update(emulated=meta["emulated"],
                          event=bytes.fromhex(event) if event is not None else None)
        except Exception as err:  # KeyError, TypeError, ValueError, OSError (a closed fd), ...
            os.close(fd)
            raise UmpError(f"a malformed export handle: {err!r}") from err
        return cls(fd, **fields)

    @property
    def fd(self) -> int:
        """The file descriptor (owned by this handle)."""
        if self._fd is None:
            raise UmpError("this export handle is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __repr__(self):
        where = "emulated" if self.emulated else f"device {self.device}"
        state = "closed" if self._fd is None else f"fd {self._fd}"
        return f"<ump.ExportHandle {self.nbytes} bytes, {where}, from pid {self.pid}, {state}>"

    def _check(self) -> int:
        """The fd, once the description is one an exporter could have made.
        Everything an importer acts on is checked here, before anything (an
        importing pool, an address range, a granule map) is spent on it."""
        fd = self.fd
        try:
            os.fstat(fd)
        except OSError as err:
            raise UmpError(f"the export handle's file descriptor {fd} is closed") from err
        from . import _core

        def field(name: str, lo: int, hi: int) -> int:
            value = getattr(self, name)
            if type(value) is not int or not lo <= value <= hi:
                raise InvalidArgumentError(f"the handle's {name} ({value!r}) must be an integer "
                                           f"from {lo} to {hi}")
            return value

        # VMM granules are powers of two from a page up (2 MiB on the GPUs
        # we measured); the memory is whole granules.
        gran = field("granularity", 4096, 1 << 30)
        nbytes = field("nbytes", gran, _core.VMM_MAX_BYTES)
        field("device", 0, 2**31 - 1)
        field("pid", 1, 2**31 - 1)
        if gran & (gran - 1) or nbytes % gran:
            raise InvalidArgumentError(f"the handle's granularity ({gran} bytes) is no power of two, "
                                       f"or its {nbytes} bytes are not whole granules")
        # The import maps nbytes (checked against the memory) and its arrays
        # span size: a larger size would reach memory that is not the handle's.
        if not (type(self.size) is int and 0 < self.size <= nbytes):
            raise InvalidArgumentError(f"the handle's size ({self.size} bytes) must be positive and "
                                       f"at most the memory behind it ({nbytes} bytes)")
        if type(self.emulated) is not bool or not (
                self.event is None or (type(self.event) is bytes and len(self.event) == EVENT_BYTES)):
            raise InvalidArgumentError(f"the handle's emulated ({self.emulated!r}) or event "
                                       f"({self.event!r}) is not one an exporter makes")
        return fd

    def _importable_by(self, pool) -> int:
        """The fd, after checking the handle and that it fits ``pool``; a
        clear error if not."""
        fd = self._check()
        if self.emulated != pool.emulated:
            raise UmpError("a handle exported by " + ("an emulated" if self.emulated else "a GPU")
                           + " pool cannot be imported into " + ("an emulated" if pool.emulated else "a GPU")
                           + " pool")
        if self.granularity != pool.granularity:
            raise UmpError(f"the handle's granularity ({self.granularity} bytes, {self.nbytes} bytes "
                           f"in all) does not match the pool's ({pool.granularity} bytes)")
        if not pool.emulated:
            # The driver cannot tell an allocation's size before mapping it,
            # and the import reserves what the handle claims: no allocation
            # is larger than the largest GPU.
            from ._probe import probe

            largest = max(d.total_memory for d in probe().devices)
            if self.nbytes > largest:
                raise InvalidArgumentError(f"the handle claims {self.nbytes} bytes, more than any "
                                           f"GPU here has ({largest} bytes)")
        return fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _rebuild_handle, (DupFd(self.fd), self._meta())


def _rebuild_handle(dup, meta: dict) -> ExportHandle:
    return ExportHandle._from_meta(dup.detach(), meta)


# --- Unix sockets that only their owner's processes may use --------------------

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _own_uid() -> int:
    return os.getuid()


def _check_peer(sock: socket.socket) -> None:
    """Refuse a peer of another user (SO_PEERCRED: what the kernel says the
    peer's uid is, which it cannot forge)."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    own = _own_uid()
    if uid != own:
        raise PermissionError(f"refused a connection from uid {uid} (pid {pid}): only processes of "
                              f"uid {own} may share memory with this one")


def _check_private_dir(path: str) -> None:
    st = os.stat(path)
    if st.st_uid != _own_uid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}: "
                              "put the socket in a directory only you can use (mode 0700)")


def _timeout(timeout) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return timeout


def _waited(timeout, what: str) -> TimeoutError:
    return TimeoutError(f"{what} within {timeout} s (a silent or stuck peer; pass timeout= to "
                        "wait longer)")


def _recv_fds(sock: socket.socket, bufsize: int, maxfds: int):
    """socket.recv_fds, but the descriptors arrive close-on-exec: CPython's
    recv_fds ignores its flags, and a descriptor marked only after receipt
    leaks into a program another thread starts meanwhile."""
    fds = array.array("i")
    msg, ancdata, flags, _ = sock.recvmsg(bufsize, socket.CMSG_SPACE(maxfds * fds.itemsize),
                                          socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds), flags


class Connection(Resource):
    """One end of a connection made by :func:`connect` or
    :meth:`Listener.accept`: :meth:`send` and :meth:`recv` export handles, one
    message each (a SOCK_SEQPACKET socket keeps message boundaries). Each
    waits at most ``timeout`` seconds for the peer (None: for ever), then
    raises TimeoutError."""

    def __init__(self, sock: socket.socket, timeout: float | None = DEFAULT_TIMEOUT):
        self._sock = sock
        self.timeout = timeout

    @property
    def timeout(self) -> float | None:
        """Seconds :meth:`send` and :meth:`recv` wait for the peer (None: for ever)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._timeout = _timeout(seconds)
        self._sock.settimeout(self._timeout)

    def send(self, handle: ExportHandle) -> None:
        """Send a handle: its description and a duplicate of its file descriptor."""
        if not isinstance(handle, ExportHandle):
            raise TypeError(f"expected an ump.ExportHandle, got {type(handle).__name__}")
        try:
            socket.send_fds(self._sock, [json.dumps(handle._meta()).encode()], [handle.fd])
        except TimeoutError:
            raise _waited(self.timeout, "the peer took no handle") from None

    def recv(self) -> ExportHandle:
        """Receive a handle.

        Raises
        ------
        EOFError
            The peer closed the connection (or died) before sending one.
        TimeoutError
            The peer sent nothing within ``timeout`` seconds.
        UmpError
            What arrived is not one handle's description and descriptor.
        """
        try:
            msg, fds, flags = _recv_fds(self._sock, 4096, 4)
        except TimeoutError:
            raise _waited(self.timeout, "the peer sent no handle") from None
        if not msg and not fds:
            raise EOFError("the peer closed the connection")
        if len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            for fd in fds:
                os.close(fd)
            raise UmpError(f"expected one export handle, received {len(fds)} file descriptor(s)")
        try:
            meta = json.loads(msg)
        except Exception as err:  # ValueError; RecursionError for deep nesting
            os.close(fds[0])
            raise UmpError("a malformed export handle") from err
        return ExportHandle._from_meta(fds[0], meta)  # closes the fd if it raises

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()


class Listener(Resource):
    """A Unix socket for handles (see :func:`listen`). It belongs to the
    process that made it: a forked child's copy closes its descriptor but
    never removes the parent's socket."""

    def __init__(self, path: str | None = None, backlog: int = 16, *,
                 timeout: float | None = DEFAULT_TIMEOUT):
        check_platform()
        self.timeout = _timeout(timeout)
        self._pid = os.getpid()
        self._dir = None
        if path is None:
            self._dir = tempfile.mkdtemp(prefix="ump-share-")  # mode 0700
            path = os.path.join(self._dir, "socket")
        else:
            path = os.path.abspath(path)
            _check_private_dir(os.path.dirname(path))
        self.address = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(backlog)
        except BaseException:
            self._sock.close()
            if self._dir is not None:
                os.rmdir(self._dir)  # bind may have failed before the socket file existed
            raise

    def accept(self) -> Connection:
        """The next connection of a process of this user, waiting at most
        ``timeout`` seconds; the connection waits as long for each handle.

        Raises
        ------
        PermissionError
            The peer runs as another user; its connection is closed.
        TimeoutError
            No process connected in time.
        """
        self._sock.settimeout(self.timeout)
        try:
            sock, _ = self._sock.accept()
        except TimeoutError:
            raise _waited(self.timeout, f"no process connected to {self.address}") from None
        try:
            _check_peer(sock)
            return Connection(sock, self.timeout)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        if self._sock.fileno() < 0:
            return
        self._sock.close()
        if os.getpid() != self._pid:
            return  # a forked child's copy: the socket's path is its maker's
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
        if self._dir is not None:
            os.rmdir(self._dir)


def listen(path: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT) -> Listener:
    """Listen for processes of this user that want handles.

    The socket is created with mode 0600 in a private directory: a new one
    (``Listener.address`` says where) or, with ``path``, the directory of
    ``path``, which must be owned by this user and closed to others
    (mode 0700). :meth:`Listener.accept` checks each peer's uid
    (SO_PEERCRED) and refuses other users. ``accept`` and the connections
    it makes wait at most ``timeout`` seconds for a peer (None: for ever).
    """
    return Listener(path, timeout=timeout)


def connect(path: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> Connection:
    """Connect to a :func:`listen` socket; the listener must run as this user.
    The connection waits at most ``timeout`` seconds for each handle.

    Raises
    ------
    PermissionError
        The listening process runs as another user.
    TimeoutError
        The listener did not answer in time.
    """
    check_platform()
    timeout = _timeout(timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except TimeoutError:
            raise _waited(timeout, f"the listener at {path} did not answer") from None
        _check_peer(sock)
        return Connection(sock, timeout)
    except BaseException:
        sock.close()
        raise
