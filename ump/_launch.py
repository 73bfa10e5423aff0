"""Turning ump on from outside a program: ``python -m ump run`` (its
options come from the option table, ``ump._options``)."""

from __future__ import annotations

import os
import runpy
import sys

__all__ = ["start", "program_path", "run"]


def start(backend: str, options: dict) -> str:
    """Enable ump for a program started from outside it.

    It sets ``UMP_LAUNCHED=1``, not ``CUPY_ENABLE_UMP=1``: child processes
    (``subprocess``, ``multiprocessing``) inherit it, so those that call
    :func:`ump.enable` (Dask workers with ump's plugin) need no variable
    either, while in those that do not, CuPy's own UMP path, which asserts
    on GPUs without HMM/ATS, stays off. A ``CUPY_ENABLE_UMP`` already in the
    environment stays as it is.
    """
    import ump

    from ._enable import LAUNCHED

    os.environ[LAUNCHED] = "1"
    return ump.enable(backend, **options)


def program_path(script: str | None = None) -> None:
    """``sys.path[0]`` as Python sets it for a program: the script's
    directory, or the working directory for ``-m``; nothing under ``-P``
    (``PYTHONSAFEPATH``)."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.getcwd() if script is None else os.path.dirname(os.path.abspath(script))


def run(*, script: str | None = None, module: str | None = None, args=()) -> None:
    """Run ``script`` or ``module`` as ``__main__`` with ``args`` as its
    command line, as ``python script.py`` or ``python -m`` would."""
    program_path(script)
    if module is not None:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
