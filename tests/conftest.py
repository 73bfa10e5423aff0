"""Shared fixtures: capabilities are probed lazily and skip with a reason."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _from_tree(path) -> bool:
    return path is not None and pathlib.Path(path).resolve().is_relative_to(ROOT)


def _test_the_installed_package():
    """`python -m pytest` puts the working directory first on sys.path, and
    pytest imports ump's plugin (an entry point) before this file runs, so in
    a source tree `ump` is this tree's. Where ump is installed elsewhere (a
    wheel, `pip install .` of an unpacked sdist), test that: this tree's
    ump/ has no built extension there, or one from another build. Drop the
    tree from sys.path and forget the modules imported from it. An editable
    install, or none, leaves the tree as it is. The tests' own Python
    processes (`python -c`, `python -m`) put their working directory first
    too: they run in a temporary directory."""
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if pathlib.Path(p or ".").resolve() != ROOT]
    tree_modules = {name: module for name, module in sys.modules.items()
                    if name.split(".")[0] == "ump" and _from_tree(getattr(module, "__file__", None))}
    for name in tree_modules:
        del sys.modules[name]
    spec = importlib.util.find_spec("ump")
    if spec is None or _from_tree(spec.origin):
        sys.path[:] = saved
        sys.modules.update(tree_modules)


_test_the_installed_package()

import numpy  # noqa: E402
import pytest  # noqa: E402

import ump  # noqa: E402
from _gpu import require_backend  # noqa: E402
from ump import _core  # noqa: E402


def pytest_report_header(config):
    return f"ump {ump.__version__} from {pathlib.Path(ump.__file__).parent}"


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
def stub_cuda(tmp_path_factory):
    """tests/c/stub_cuda.c built as a driver (tests/_stub.py runs Python on it)."""
    import _stub

    return _stub.build(tmp_path_factory.mktemp("stub"))


@pytest.fixture(scope="session")
def gpu_caps(caps):
    if not caps.gpu:
        pytest.skip(f"needs a CUDA GPU: {caps.reason}")
    if caps.cupy_version is None:
        pytest.skip("needs CuPy (pip install ump[cuda12] or ump[cuda13])")
    if os.environ.get("CUPY_ENABLE_UMP") != "1":
        pytest.skip("GPU tests run with CUPY_ENABLE_UMP=1 in the environment")
    return caps


@pytest.fixture
def vmm_cupy(gpu_caps):
    """CuPy, on a GPU that supports virtual memory management (VMM pools)."""
    if not gpu_caps.devices[0].vmm_supported:
        pytest.skip(f"{gpu_caps.devices[0].name} does not support VMM")
    from ump._cupy_compat import import_cupy

    return import_cupy()


def gpu_backends(caps):
    from ump import backends

    return [n for n in backends.AUTO_ORDER if backends.get(n).unavailable(caps, caps.devices[0]) is None]


@pytest.fixture(params=["system", "managed", "pinned"])
def gpu_backend(request, gpu_caps):
    """Each unified backend the GPU can run, enabled for the test (a module
    may parametrize it indirectly with other backends, "device" included)."""
    name = request.param
    require_backend(gpu_caps, name)
    ump.enable(name, cap=4 << 30)
    import cupy

    yield name, cupy
    cupy.cuda.runtime.deviceSynchronize()
