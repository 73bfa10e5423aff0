"""The C core under AddressSanitizer + UndefinedBehaviorSanitizer and
ThreadSanitizer, driven by the programs in tests/c/: stress.c (8 threads, over
a million operations), arena_race.c (the arenas' lock-free paths against
trim, double frees and fault injection), pool_race.c (VMM pools destroyed
while other threads use them), ctx_race.c (ump's CUDA context changed
under provider calls, through stub_cuda.c), probe.c (the devices' calls,
through stub_cuda.c) and fuzz.c (random calls with hostile arguments,
checked against a model)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# every unit of the core but the Python module
CORE = sorted(p for p in (ROOT / "csrc").glob("*.c") if p.name != "module.c")
CC = os.environ.get("CC", "cc")
ASAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
ASAN_ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
TSAN = ["-fsanitize=thread"]
TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1"}


def _build(tmp_path, driver, flags):
    """tests/c/<driver>.c linked with the core, built with ``flags``."""
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler ({CC}) to build the sanitizer driver")
    exe = tmp_path / driver
    sources = [*CORE, ROOT / "tests" / "c" / f"{driver}.c"]
    cmd = [CC, "-std=gnu11", "-g", "-O1", "-fno-omit-frame-pointer", "-pthread", *flags,
           *map(str, sources), "-ldl", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        if "sanitize" in proc.stderr or "cannot find" in proc.stderr:
            pytest.skip(f"{CC} cannot build with {' '.join(flags)}: {proc.stderr.strip()[:200]}")
        pytest.fail(proc.stderr)
    return exe


def _run(exe, count, env, *args):
    proc = subprocess.run([str(exe), str(count), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr[-4000:]
    assert "ERROR" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-4000:]
    return proc.stdout


def test_stress_under_asan_and_ubsan(tmp_path):
    out = _run(_build(tmp_path, "stress", ASAN), 150_000, ASAN_ENV)
    assert "1200000 ops" in out and "pool: " in out


def test_stress_under_tsan(tmp_path):
    _run(_build(tmp_path, "stress", TSAN), 20_000, TSAN_ENV)


# Each phase of arena_race.c sets one race up many times; without its fix each
# fails in well under a second: a free through a thread cache read the
# chunk_t of a hinted slab that a concurrent trim had freed (ASan and TSan:
# heap-use-after-free); a block freed at once through a thread cache and the
# locked path was freed twice (its check: exactly one free is refused); two
# provider calls both took the last injected failure and left the count at
# -1, failing every later call; and blocks taken from thread caches were
# missing from total_count.
def test_arena_races_under_asan_and_ubsan(tmp_path):
    out = _run(_build(tmp_path, "arena_race", ASAN), 100_000, ASAN_ENV)
    assert "1000000 rounds" in out and "injection: 10000 rounds" in out and "statistics: " in out


def test_arena_races_under_tsan(tmp_path):
    out = _run(_build(tmp_path, "arena_race", TSAN), 20_000, TSAN_ENV)
    assert "200000 rounds" in out and "statistics: " in out


# A call that had resolved a pool's id just before another thread destroyed
# the pool used to lock the destroyed mutex and work on freed or wiped state:
# TSan reports the race; otherwise the racing calls fail with statuses that
# are not UMP_ERR_HANDLE (the wiped pool's UMP_ERR_CAP), or ASan stops at a
# use-after-free. The destroy that works also races lookups (which pin every
# open pool, so one of them may be the last pin and free the slot) and the
# creation of blocks, buffers, rings and aliases (which must then fail with
# UMP_ERR_HANDLE): a lookup that read a destroyed pool's freed regions is a
# use-after-free under both sanitizers.
def test_pool_destroyed_under_its_users_under_asan_and_ubsan(tmp_path):
    out = _run(_build(tmp_path, "pool_race", ASAN), 200, ASAN_ENV)
    assert "200 rounds" in out and "lookups: " in out


def test_pool_destroyed_under_its_users_under_tsan(tmp_path):
    out = _run(_build(tmp_path, "pool_race", TSAN), 100, TSAN_ENV)
    assert "100 rounds" in out


# Random calls with hostile sizes, pointers, ids and descriptors, and injected
# driver failures (CUresults as well as ump's own), each checked against a
# model of the pool and against the data in every live block. The seed is the
# first line of the output, which a failure shows: UMP_FUZZ_SEED=<seed> reruns it.
FUZZ_OPS = 60_000


def test_random_hostile_calls_under_asan_and_ubsan(tmp_path):
    exe = _build(tmp_path, "fuzz", ASAN)
    seed = os.environ.get("UMP_FUZZ_SEED")
    env = {**ASAN_ENV, "ASAN_OPTIONS": ASAN_ENV["ASAN_OPTIONS"] + ":allocator_may_return_null=1"}
    out = _run(exe, FUZZ_OPS, env, *([seed] if seed else []))
    assert out.startswith("fuzz seed: ") and f"fuzz: {FUZZ_OPS} ops" in out


# enable() sets ump's context and device while NumPy allocates on other
# threads, whose provider calls push that context and advise that device:
# written and read as plain globals, TSan reported the race at once.
def test_context_changed_under_provider_calls_under_tsan(tmp_path, stub_cuda):
    exe = _build(tmp_path, "ctx_race", TSAN)
    out = _run(exe, 2000, {**TSAN_ENV, "UMP_TEST_LIBCUDA": str(stub_cuda)})
    assert "2000 rounds" in out


# The probe, primary contexts, free memory and peers through the driver table,
# with no driver and then with the stub: every call checked, every retain
# released, from four threads at once.
def test_device_calls_under_asan_and_ubsan(tmp_path, stub_cuda):
    out = _run(_build(tmp_path, "probe", ASAN), 1000, {**ASAN_ENV, "UMP_TEST_LIBCUDA": str(stub_cuda)})
    assert "1000 rounds x 4 threads" in out


def test_device_calls_under_tsan(tmp_path, stub_cuda):
    out = _run(_build(tmp_path, "probe", TSAN), 500, {**TSAN_ENV, "UMP_TEST_LIBCUDA": str(stub_cuda)})
    assert "500 rounds x 4 threads" in out


def test_extension_in_python_under_valgrind():
    """Valgrind's memcheck over a Python process using the extension through
    NumPy's hooks and the VMM pool: no error in ump's code (errors of the
    dynamic loader and of CPython itself are not ours and are ignored)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        pytest.skip("valgrind is not installed")
    import sys

    proc = subprocess.run(
        [valgrind, "--error-limit=no", "--num-callers=40", sys.executable,
         str(ROOT / "tests" / "valgrind" / "workload.py")],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONMALLOC": "malloc"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), proc.stderr[-3000:]
    assert "block of size 4,321 free'd" in proc.stderr  # valgrind saw the deliberate error
    ours = [b for b in proc.stderr.split("== \n") if "_ucore" in b and ("Invalid" in b or "uninitialised" in b)]
    assert not ours, ours[0][-3000:]
