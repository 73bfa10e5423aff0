"""The stub CUDA driver (tests/c/stub_cuda.c), built once per session, and
a way to run Python against it: a fresh process whose C core opened the stub
as its libcuda, so nothing of it stays in the test process (the core opens
one driver for the life of a process)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CC = os.environ.get("CC", "cc")


def build(directory: pathlib.Path) -> pathlib.Path:
    """tests/c/stub_cuda.c as a shared library ump_cuda_load() accepts."""
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler ({CC}) to build the stub driver")
    lib = directory / "libcuda_stub.so"
    proc = subprocess.run([CC, "-shared", "-fPIC", "-O1", str(ROOT / "tests" / "c" / "stub_cuda.c"),
                           "-o", str(lib)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(proc.stderr)
    return lib


#: What every script starts with: the stub opened as the driver, and a way
#: to read how many retains of a device's context it holds.
PRELUDE = """
import ctypes, json, os, sys
from ump import _core
STUB = ctypes.CDLL(os.environ["UMP_TEST_LIBCUDA"])
assert _core._cuda_load(os.environ["UMP_TEST_LIBCUDA"].encode()) == _core.OK
def retained(device=0):
    return STUB.stub_cuda_retained(device)
"""


def run(lib: pathlib.Path, code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python whose driver is the stub at ``lib``."""
    environ = {**os.environ, "UMP_TEST_LIBCUDA": str(lib), **env}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True,
                          text=True, env=environ, cwd=tmp_path, timeout=120)


def result(proc: subprocess.CompletedProcess):
    """The JSON the script printed last, once it exited cleanly."""
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])
