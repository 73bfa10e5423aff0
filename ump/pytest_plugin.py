"""pytest plugin: run any project's test suite under ump with one flag.

    python -m pytest --ump                 # backend "auto"
    python -m pytest --ump=pinned --ump-cap=4G

Installed with ump (entry point ``pytest11``); without the package
installed, load it with ``-p ump.pytest_plugin``. ump is enabled in
``pytest_configure``, in the main process and in every pytest-xdist worker,
after the initial conftest files ran: CuPy may be imported by then (CuPy's
own test settings import it), which ump supports. The ``UMP_*`` environment
variables of ``python -m ump run`` apply as well; flags win.
"""

from __future__ import annotations

import pytest

from ._launch import settings


def pytest_addoption(parser):
    group = parser.getgroup("ump", "unified memory for NumPy and CuPy")
    group.addoption("--ump", nargs="?", const="auto", default=None, metavar="BACKEND",
                    help="enable ump (backend: auto, system, managed, pinned, device, host)")
    group.addoption("--ump-cap", default=None, metavar="SIZE",
                    help="ump's budget: bytes (4G, 512MiB) or a fraction of free device memory")
    group.addoption("--ump-placement", default=None, choices=("auto", "host", "migrate"),
                    help="placement of managed NumPy blocks")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    backend = config.getoption("ump", None)
    if backend is None:
        return
    import ump

    name, options = settings({"backend": backend, "cap": config.getoption("ump_cap"),
                              "placement": config.getoption("ump_placement")})
    ump.enable(name, **options)


def pytest_report_header(config):
    if config.getoption("ump", None) is None:
        return None
    import ump

    return f"ump: backend {ump.backend()}"
