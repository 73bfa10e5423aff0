"""pytest plugin: run any project's test suite under ump with one flag.

    python -m pytest --ump tests/          # backend "auto"
    python -m pytest --ump=pinned --ump-cap=4G

Installed with ump (entry point ``pytest11``, named ``ump.pytest_plugin``
after the module, so that ``-p ump.pytest_plugin`` names the same plugin
where ump is installed; ``-p no:ump.pytest_plugin`` turns it off); without
the package installed, load it with ``-p ump.pytest_plugin``.

Every pytest session of the environment loads the plugin, so it imports
nothing of ump but the option table until ``--ump`` is given. ``--ump``
takes an optional value: ``--ump tests/`` is ``--ump`` before a path, and
``--ump=BACKEND`` names a backend. ump is enabled in ``pytest_configure``,
in the main process and in every pytest-xdist worker, after the initial
conftest files ran: CuPy may be imported by then (CuPy's own test settings
import it), which ump supports. The ``UMP_*`` environment variables of
``python -m ump run`` apply as well (``--ump`` without a value takes
``UMP_BACKEND``, else ``auto``); flags win. The ``--ump-*`` flags set
options of ump, so they need ``--ump``.

Under pytest-xdist each of N workers on one GPU gets, unless a cap is set,
0.9/N of the device's free memory: N processes each taking the default
budget would together ask for N times what the GPU has.
"""

from __future__ import annotations

import os

import pytest

from ._options import BACKEND, TABLE, argparse_type, resolve

# --ump is BACKEND's flag; every other option is --ump-NAME.
_OPTIONS = [option for option in TABLE.values() if option is not BACKEND]


def pytest_addoption(parser):
    group = parser.getgroup("ump", "unified memory for NumPy and CuPy")
    group.addoption("--ump", nargs="?", const="", default=None, metavar="BACKEND",
                    help=f"enable ump: {BACKEND.describe()}")
    for option in _OPTIONS:
        group.addoption(option.flag("--ump-"), dest=f"ump_{option.name}", default=None, metavar=option.metavar,
                        choices=option.choices, type=None if option.choices else argparse_type(option),
                        help=f"with --ump: {option.describe()}")


def _looks_like_a_path(value: str) -> bool:
    """``--ump tests/`` hands pytest's path to ``--ump`` as its value."""
    if value in BACKEND.choices:
        return False
    return (os.sep in value or "/" in value or value.endswith(".py") or "::" in value
            or os.path.exists(value))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # ``--ump PATH``: give the path back to pytest, before it picks the
    # initial conftests from its paths (and, through ``args``, before the
    # final parse that collects them).
    for i, arg in enumerate(args[:-1]):
        if arg == "--":
            break
        if arg == "--ump" and _looks_like_a_path(args[i + 1]):
            args[i] = "--ump="
            namespace = early_config.known_args_namespace
            again = parser.parse_known_args(args)
            namespace.ump, namespace.file_or_dir = again.ump, again.file_or_dir


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    flags = {option.name: config.getoption(f"ump_{option.name}", None) for option in _OPTIONS}
    backend = config.getoption("ump", None)
    if backend is None:
        given = [option.flag("--ump-") for option in _OPTIONS if flags[option.name] is not None]
        if given:
            raise pytest.UsageError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} an option of ump, "
                                    "which only --ump enables: add --ump (or --ump=BACKEND)")
        return
    if backend and backend not in BACKEND.choices:
        raise pytest.UsageError(f"--ump: unknown backend {backend!r}; choose one of "
                                f"{', '.join(BACKEND.choices)} (--ump=BACKEND)")
    import ump

    flags["backend"] = backend or None
    try:
        name, options = resolve(flags)
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
