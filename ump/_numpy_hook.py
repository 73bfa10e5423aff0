"""NumPy's side: ump's C hooks as the NEP 49 handler, through numpy_allocator.

NumPy keeps its handler in a context variable, and before Python 3.14 a new
thread starts in an empty context: arrays made there would use NumPy's
default handler. While ump is enabled, threads started through ``threading``
(``ThreadPoolExecutor`` included) enter ump's handler before they run and
leave it when they end. Threads that were already running keep the handler
they had.
"""

from __future__ import annotations

import threading

from . import _core

__all__ = ["install", "uninstall", "handler_class", "owns", "handler_name"]

try:  # NumPy >= 2
    from numpy._core.multiarray import get_handler_name as handler_name
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import get_handler_name as handler_name

_allocator = None  # the numpy_allocator class, made once
_original_bootstrap = threading.Thread._bootstrap_inner


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


def _bootstrap_inner(thread):
    allocator = _allocator
    allocator.__enter__()
    try:
        _original_bootstrap(thread)
    finally:
        allocator.__exit__(None, None, None)


def install(arena_id: int) -> None:
    """Serve NumPy from ``arena_id`` in this thread and in threads started later."""
    allocator = handler_class()
    _core.check(_core.set_numpy_arena(arena_id), "selecting the NumPy arena")
    allocator.__enter__()
    threading.Thread._bootstrap_inner = _bootstrap_inner


def uninstall() -> None:
    """Restore the handler that was active before :func:`install`.

    Blocks allocated meanwhile stay valid: NumPy frees each array through the
    handler that allocated it, and ump's C hooks outlive this call.
    """
    threading.Thread._bootstrap_inner = _original_bootstrap
    _allocator.__exit__(None, None, None)
    # Threads still running with ump's handler now get plain aligned memory.
    _core.set_numpy_arena(-1)


def owns(array) -> bool:
    """Whether NumPy allocated ``array``'s data (or its base's) through ump."""
    return bool(handler_class().handles(array))
