"""Handles between processes of one host, over sockets only their owner may use.

``listen()`` makes a Unix socket (mode 0600, in a private directory) whose
``accept()`` refuses processes of another user (SO_PEERCRED); ``connect()``
reaches it. A :class:`Connection` sends and receives :class:`ump.ExportHandle`
objects. See docs/pools.md, "Sharing".
"""

from ._share import Connection, ExportHandle, Listener, connect, listen
from ._vmm import import_handle

__all__ = ["Connection", "ExportHandle", "Listener", "connect", "import_handle", "listen"]
