"""Shared fixtures: capabilities are probed lazily and skip with a reason."""

from __future__ import annotations

import os

import numpy
import pytest

import ump
from ump import _core


@pytest.fixture(autouse=True)
def _restore_allocators():
    """Every test leaves NumPy's (and CuPy's) allocator as it found it."""
    before = numpy._core.multiarray.get_handler_name()
    yield
    ump.disable()
    _core.fault_inject(0, 0)
    assert numpy._core.multiarray.get_handler_name() == before


@pytest.fixture(autouse=True)
def _serial(request):
    if request.node.get_closest_marker("serial") and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("reads the GPU's free memory, which other test processes change: "
                    "run it without -n (pytest -m serial)")


@pytest.fixture(scope="session")
def caps():
    return ump.probe()


@pytest.fixture(scope="session")
def gpu_caps(caps):
    if not caps.gpu:
        pytest.skip(f"needs a CUDA GPU: {caps.reason}")
    if caps.cupy_version is None:
        pytest.skip("needs CuPy (pip install ump[cuda12] or ump[cuda13])")
    if os.environ.get("CUPY_ENABLE_UMP") != "1":
        pytest.skip("GPU tests run with CUPY_ENABLE_UMP=1 in the environment")
    return caps


def gpu_backends(caps):
    from ump import backends

    return [n for n in backends.AUTO_ORDER if backends.get(n).unavailable(caps, caps.devices[0]) is None]


@pytest.fixture(params=["system", "managed", "pinned"])
def gpu_backend(request, gpu_caps):
    """Each unified backend the GPU can run, enabled for the test."""
    from ump import backends

    name = request.param
    why = backends.get(name).unavailable(gpu_caps, gpu_caps.devices[0])
    if why is not None:
        pytest.skip(f"backend {name} cannot run here: {why}")
    ump.enable(name, cap=4 << 30)
    import cupy

    yield name, cupy
    cupy.cuda.runtime.deviceSynchronize()
