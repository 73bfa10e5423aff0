"""NumPy's side: ump's C hooks as the NEP 49 handler, through numpy_allocator.

NumPy keeps its handler in a context variable, and a new thread runs in a
context of its own: an empty one before Python 3.14, and on 3.14 the
thread's ``_context``, empty as well unless ``-X thread_inherit_context``
(the default of free-threaded builds) makes it a copy of the starter's.
Arrays made there would use NumPy's default handler. While ump is enabled,
threads started through ``threading`` (``ThreadPoolExecutor`` included) set
ump's handler in the context their ``run()`` runs in before it starts, and
put the one they had back when it ends. Threads that were already running
keep the handler they had.

The handler is set with ``numpy_allocator.set_handler`` and the one it
replaced is kept here, per enable: numpy_allocator's ``__enter__`` and
``__exit__`` keep the handlers to restore on one list that every thread
shares, so an ``__exit__`` in one thread can restore what another thread
saved.
"""

from __future__ import annotations

import contextvars
import threading

from . import _core
from ._errors import UmpError

__all__ = ["install", "uninstall", "check_uninstall", "enter", "handler_class", "owns", "handler_name"]

try:  # NumPy >= 2
    from numpy._core.multiarray import get_handler_name as handler_name
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import get_handler_name as handler_name

_allocator = None  # the numpy_allocator class, made once
_original_bootstrap = threading.Thread._bootstrap_inner
_handler = None  # ump's handler (a capsule) while installed
_owner = None  # (the thread that called install(), the handler it replaced there)


def handler_class():
    """The numpy_allocator class whose handler NumPy reports as ``"ump"``."""
    global _allocator
    if _allocator is None:
        import numpy_allocator

        hooks = _core.HOOK_ADDRESSES
        # numpy_allocator calls the C functions through these addresses
        # directly, without the GIL; the library stays loaded in _core.
        _allocator = numpy_allocator.type(
            "ump",
            (),
            {
                "_malloc_": hooks["malloc"],
                "_calloc_": hooks["calloc"],
                "_realloc_": hooks["realloc"],
                "_free_": hooks["free"],
            },
        )
    return _allocator


def _set_handler(handler):
    """Make ``handler`` NumPy's handler in the current context; return the
    one it replaced."""
    import numpy_allocator

    return numpy_allocator.set_handler(handler)


def _run_in(thread):
    """How to run code in the context ``thread.run()`` will run in: Python
    3.14 runs it in ``thread._context`` (a Context of its own), earlier
    versions in the thread's own context, where this already runs."""
    context = getattr(thread, "_context", None)
    if isinstance(context, contextvars.Context):
        return context.run
    return lambda fn, *args: fn(*args)


def _bootstrap_inner(thread):
    handler = _handler
    if handler is None:  # ump was disabled while the thread started
        return _original_bootstrap(thread)
    run = _run_in(thread)
    try:
        previous = run(_set_handler, handler)
    except RuntimeError:  # a context another thread is in (Thread(context=...) shared)
        run = _run_in(None)
        previous = run(_set_handler, handler)
    try:
        _original_bootstrap(thread)
    finally:
        run(_set_handler, previous)


def install(arena_id: int) -> None:
    """Serve NumPy from ``arena_id`` in this thread and in threads started later."""
    global _handler, _owner
    handler = handler_class().handler()
    _core.check(_core.set_numpy_arena(arena_id), "selecting the NumPy arena")
    previous = _set_handler(handler)
    _handler = handler
    _owner = (threading.current_thread(), previous)
    threading.Thread._bootstrap_inner = _bootstrap_inner


def enter() -> None:
    """Make ump's handler NumPy's in the current context (a Dask task's,
    say); nothing if ump is not installed. It stays there for the life of
    the context."""
    if _handler is not None and handler_name() != "ump":
        _set_handler(_handler)


def check_uninstall() -> None:
    """Raise :class:`UmpError` where :func:`uninstall` could not restore
    NumPy's handler: called from a thread other than the one that installed
    it, while that one still runs (a thread cannot change another thread's
    context variables).

    A thread that has ended has no context left to restore, so once the
    installing thread is gone any thread may uninstall.
    """
    if _owner is None:
        return
    thread = _owner[0]
    # A thread Python did not start (C code, _thread) is known only as a
    # dummy that never ends: its context cannot be restored from here, and
    # waiting for it to end would refuse for good.
    if (thread is not threading.current_thread() and thread.is_alive()
            and not isinstance(thread, threading._DummyThread)):
        raise UmpError(
            f"ump.disable() must be called from the thread that called ump.enable() ({thread.name}), "
            f"not from {threading.current_thread().name}: NumPy's allocator is per thread (a context "
            "variable), and only that thread can put its own back. Nothing was changed.")


def uninstall() -> None:
    """Restore the handler that was active before :func:`install` (in the
    thread that installed it; see :func:`check_uninstall`).

    Blocks allocated meanwhile stay valid: NumPy frees each array through the
    handler that allocated it, and ump's C hooks outlive this call.
    """
    global _handler, _owner
    threading.Thread._bootstrap_inner = _original_bootstrap
    owner, _handler = _owner, None
    _owner = None
    if owner is not None and owner[0] is threading.current_thread():
        _set_handler(owner[1])
    # Threads still running with ump's handler now get plain aligned memory.
    _core.set_numpy_arena(-1)


def owns(array) -> bool:
    """Whether NumPy allocated ``array``'s data (or its base's) through ump."""
    return bool(handler_class().handles(array))
