"""pytest plugin: enable ump before any test runs (each xdist worker too).

Used to run NumPy's own test suite with ump's allocator active:
    PYTHONPATH=tools python -m pytest -p ump_numpy_plugin --pyargs numpy._core
"""

import ump


def pytest_configure(config):
    ump.enable()
    config.stash_ump_backend = ump.backend()


def pytest_report_header(config):
    return f"ump enabled: backend {ump.backend()}"
