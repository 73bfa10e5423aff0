"""pytest plugin: enable ump before any test runs (each xdist worker too).

Used to run NumPy's own test suite with ump's allocator active:
    PYTHONPATH=tools python -m pytest -p ump_numpy_plugin --pyargs numpy._core
If UMP_PLUGIN_REPORT names a file, each process appends the backend it enabled.
"""

import os

import ump


def pytest_configure(config):
    ump.enable()
    report = os.environ.get("UMP_PLUGIN_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(f"{os.getpid()} {ump.backend()}\n")
