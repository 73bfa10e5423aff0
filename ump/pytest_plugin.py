"""pytest plugin: run any project's test suite under ump with one flag.

    python -m pytest --ump                 # backend "auto"
    python -m pytest --ump=pinned --ump-cap=4G

Installed with ump (entry point ``pytest11``, named ``ump.pytest_plugin``
after the module, so that ``-p ump.pytest_plugin`` names the same plugin
where ump is installed; ``-p no:ump.pytest_plugin`` turns it off); without
the package installed, load it with ``-p ump.pytest_plugin``. ``--ump`` takes an optional value:
before a path write ``--ump=BACKEND``, as ``--ump tests/`` would read the
path as the backend (the plugin says so). ump is enabled in
``pytest_configure``, in the main process and in every pytest-xdist worker,
after the initial conftest files ran: CuPy may be imported by then (CuPy's
own test settings import it), which ump supports. The ``UMP_*`` environment
variables of ``python -m ump run`` apply as well (``--ump`` without a value
takes ``UMP_BACKEND``, else ``auto``); flags win.

Under pytest-xdist each of N workers on one GPU gets, unless a cap is set,
0.9/N of the device's free memory: N processes each taking the default
budget would together ask for N times what the GPU has.
"""

from __future__ import annotations

import os

import pytest

from ._launch import settings


_FLAGS = ("cap", "headroom", "placement", "sync", "device")


def pytest_addoption(parser):
    group = parser.getgroup("ump", "unified memory for NumPy and CuPy")
    group.addoption("--ump", nargs="?", const="", default=None, metavar="BACKEND",
                    help="enable ump (backend: auto, system, managed, pinned, device, host; "
                         "default UMP_BACKEND, else auto)")
    group.addoption("--ump-cap", default=None, metavar="SIZE",
                    help="ump's budget: bytes (4G, 512MiB) or a fraction of free device memory")
    group.addoption("--ump-headroom", default=None, metavar="SIZE", help="device memory left to others")
    group.addoption("--ump-placement", default=None, choices=("auto", "host", "migrate"),
                    help="placement of managed NumPy blocks")
    group.addoption("--ump-sync", default=None, choices=("device", "stream"), help="what exports wait for")
    group.addoption("--ump-device", default=None, metavar="INDEX", help="the CUDA device")


def _looks_like_a_path(value: str) -> bool:
    """``--ump tests/`` hands pytest's path to ``--ump`` as its value."""
    from .backends import names

    if value in ("auto", *names()):
        return False
    return (os.sep in value or "/" in value or value.endswith(".py") or "::" in value
            or os.path.exists(value))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    backend = config.getoption("ump", None)
    if backend is None:
        return
    if _looks_like_a_path(backend):
        raise pytest.UsageError(
            f"--ump: {backend!r} is not a backend but looks like a path, which --ump took as its value: "
            f"write --ump=BACKEND (--ump=auto {backend}), or put --ump after the paths")
    import ump

    flags = {name: config.getoption(f"ump_{name}") for name in _FLAGS}
    flags["backend"] = backend or None
    try:
        name, options = settings(flags)
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if "cap" not in options and workers > 1:
            options["cap"] = 0.9 / workers
        ump.enable(name, **options)
    except (ValueError, TypeError, ump.UmpError) as err:
        raise pytest.UsageError(f"--ump: {err}") from err


def pytest_report_header(config):
    if config.getoption("ump", None) is None:
        return None
    import ump

    return f"ump: backend {ump.backend()}"
