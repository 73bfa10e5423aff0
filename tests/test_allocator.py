"""The C core through its exported functions: hooks, arenas, registry."""

from __future__ import annotations

import ctypes
import os
import random
import sys

import numpy as np
import pytest

from _threads import run_threads
from ump import UmpError, _core

MiB = 1 << 20


@pytest.fixture
def arena():
    """A host arena with its own cap; serving NumPy's hooks while the test runs."""
    a = _core.Arena("host", _core.PROVIDER_HOST, 1 << 30)
    previous = _core.get_numpy_arena()
    _core.set_numpy_arena(a.id)
    yield a
    _core.set_numpy_arena(previous)
    a.trim()


SIZES = [0, 1, 7, 511, 512, 513, 4096, 4097, 65536 + 3, MiB - 1, MiB, MiB + 1, 3 * MiB + 5, 40 * MiB]


@pytest.mark.parametrize("size", SIZES)
def test_malloc_alignment_and_rounding(arena, size):
    p = _core.malloc(size)
    assert p and p % 512 == 0
    kind, base, block = _core.lookup(p)
    assert kind == "host" and base == p
    assert block % 512 == 0 and block >= max(size, 1)
    assert block <= max(512, size * 1.125 + 512)  # bounded internal waste
    ctypes.memset(p, 0xAB, max(size, 1))
    _core.free(p, size)
    assert _core.lookup(p)[0] is None


def test_interior_pointers_resolve_to_their_block(arena):
    p = _core.malloc(10_000)
    assert _core.lookup(p + 9_999)[:2] == ("host", p)
    q = _core.malloc(5 * MiB)
    assert _core.lookup(q + 5 * MiB - 1)[:2] == ("host", q)
    assert _core.lookup(q + 5 * MiB + 100)[:2] != ("host", q)  # past the block
    _core.free(p, 0)
    _core.free(q, 0)


def test_lookup_of_what_is_no_address(arena):
    p = _core.malloc(100)
    assert _core.lookup(np.uintp(p))[:2] == ("host", p)  # any integer type
    assert _core.lookup_owner(p)[3] == arena.id
    for number in (-1, -p, 1 << 64, 1 << 200):
        assert _core.lookup(number) == (None, 0, 0)
    with pytest.raises(TypeError, match="integer"):
        _core.lookup(float(p))
    _core.free(p, 0)


def test_calloc_zeroes_reused_memory(arena):
    for size in (600, 200_000, 6 * MiB):
        p = _core.malloc(size)
        ctypes.memset(p, 0xFF, size)
        _core.free(p, size)
        q = _core.calloc(size, 1)
        assert q == p  # the same block comes back...
        assert ctypes.string_at(q, size) == bytes(size)  # ...zeroed
        _core.free(q, size)


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_calloc_of_a_reused_large_block_gives_its_pages_back(arena):
    """A reused block of 32 MiB or more of host memory is zeroed as a fresh
    mapping is (what stock NumPy's calloc gets at that size), by giving its
    pages back: every byte reads zero and is committed again only where
    written. A memset would commit all of it at once (np.zeros of a size
    the machine holds only sparsely would exhaust its memory)."""
    size = 256 * MiB + 100  # ends in part of a page, which is written
    p = _core.malloc(size)
    block = np.frombuffer((ctypes.c_char * size).from_address(p), np.uint8)
    block[:] = 0xFF  # every page committed
    _core.free(p, size)
    before = _resident()
    q = _core.calloc(size, 1)
    assert q == p  # the same block comes back...
    assert _resident() < before - 128 * MiB  # ...its pages given back
    assert not block.any()  # reading zeros commits nothing either
    assert _resident() < before - 128 * MiB
    _core.free(q, size)


def test_calloc_rejects_overflow(arena):
    assert not _core.calloc(1 << 62, 8)
    assert not _core.calloc(sys.maxsize, sys.maxsize)
    assert _core.error_name(_core.last_status()) == "UMP_ERR_ARG"
    p = _core.calloc(0, 8)  # a unique non-NULL pointer, as calloc allows
    assert p
    _core.free(p, 0)


def test_malloc_of_absurd_size_fails_cleanly(arena):
    assert not _core.malloc(2**64 - 1)
    assert not _core.malloc(2**63)


@pytest.mark.parametrize("start,end", [(100, 50_000), (50_000, 100), (1000, 3 * MiB),
                                       (3 * MiB, 10 * MiB), (10 * MiB, 1000), (512, 512)])
def test_realloc_keeps_data_and_alignment(arena, start, end):
    p = _core.malloc(start)
    pattern = random.Random(start).randbytes(start)
    ctypes.memmove(p, pattern, start)
    q = _core.realloc(p, end)
    assert q and q % 512 == 0
    keep = min(start, end)
    assert ctypes.string_at(q, keep) == pattern[:keep]
    kind, base, block = _core.lookup(q)
    assert kind == "host" and base == q and block >= end
    if q != p:
        assert _core.lookup(p)[0] is None or _core.lookup(p)[1] != p
    _core.free(q, end)


def test_realloc_null_is_malloc_and_foreign_is_refused(arena):
    p = _core.realloc(None, 1000)
    assert _core.lookup(p)[0] == "host"
    _core.free(p, 1000)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    foreign = libc.malloc(64)
    assert not _core.realloc(foreign, 128)  # never realloc'd by the wrong allocator
    libc.free(ctypes.c_void_p(foreign))


def test_free_null_and_foreign_pointers(arena):
    _core.free(None, 0)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    foreign = libc.malloc(4096)
    before = _core.foreign_frees()
    _core.free(foreign, 4096)  # not ours: must not be freed (libc would double free later)
    assert _core.foreign_frees() == before + 1
    libc.free(ctypes.c_void_p(foreign))
    p = _core.malloc(1000)
    _core.free(p + 512, 1000)  # interior pointer of a live block
    _core.free(p, 1000)
    _core.free(p, 1000)  # double free
    assert _core.foreign_frees() == before + 3
    assert _core.lookup(p)[0] is None


def test_statistics_and_trim(arena):
    s0 = arena.statistics()
    ptrs = [_core.malloc(n) for n in (100, 5000, 2 * MiB, 7 * MiB)]
    s1 = arena.statistics()
    assert s1.current_count == s0.current_count + 4
    assert s1.current_bytes >= s0.current_bytes + 9 * MiB
    assert s1.peak_bytes >= s1.current_bytes and s1.held_bytes >= s1.current_bytes
    for p in ptrs:
        _core.free(p, 0)
    s2 = arena.statistics()
    assert (s2.current_bytes, s2.current_count) == (s0.current_bytes, s0.current_count)
    assert s2.cached_bytes > 0
    arena.trim()
    s3 = arena.statistics()
    assert s3.cached_bytes == 0 and s3.held_bytes == s0.held_bytes - s0.cached_bytes
    assert s3.chunk_frees > s0.chunk_frees


def test_cap_makes_numpy_fall_back(arena):
    arena.trim()
    arena.set_cap(arena.statistics().held_bytes + 8 * MiB)
    try:
        inside = _core.malloc(6 * MiB)
        assert _core.lookup(inside)[0] == "host"
        fb_before = _core.fallback_statistics()
        outside = _core.malloc(6 * MiB)  # past the cap: plain memory, still usable
        assert outside and outside % 512 == 0 and _core.lookup(outside)[0] is None
        ctypes.memset(outside, 1, 6 * MiB)
        assert _core.fallback_statistics().current_count == fb_before.current_count + 1
        with pytest.raises(_core.OutOfMemoryError):
            arena.allocate(6 * MiB)  # the CuPy-side path raises instead
        assert arena.statistics().failures >= 1
        grown = _core.realloc(outside, 7 * MiB)  # fallback blocks realloc too
        assert ctypes.string_at(grown, 16) == b"\x01" * 16
        _core.free(grown, 0)
        _core.free(inside, 0)
        assert _core.fallback_statistics().current_count == fb_before.current_count
    finally:
        arena.set_cap(1 << 30)


def test_fault_injection(arena):
    arena.trim()
    _core.fault_inject(0, -1)  # every provider call fails
    try:
        with pytest.raises(_core.OutOfMemoryError, match="UMP_ERR_INJECTED"):
            arena.allocate(9 * MiB)
        p = _core.malloc(9 * MiB)  # NumPy's path falls back
        assert p and _core.lookup(p)[0] is None
        _core.free(p, 0)
    finally:
        _core.fault_inject(0, 0)
    _core.fault_inject(1, 1)  # the second provider call fails
    try:
        a = arena.allocate(9 * MiB)
        with pytest.raises(_core.OutOfMemoryError):
            arena.allocate(9 * MiB)
        b = arena.allocate(9 * MiB)
        arena.deallocate(a)
        arena.deallocate(b)
    finally:
        _core.fault_inject(0, 0)


def test_registry_lookups_from_many_threads(arena):
    def worker(seed):
        rng = random.Random(seed)
        mine = []
        for _ in range(3000):
            if mine and rng.random() < 0.45:
                p, n = mine.pop(rng.randrange(len(mine)))
                kind, base, block = _core.lookup(p + n - 1)
                assert kind == "host" and base == p and block >= n
                assert ctypes.string_at(p, 8) == (p & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
                _core.free(p, n)
            else:
                n = rng.choice([8, 600, 5000, 70_000, 300_000, 2 * MiB + 3])
                p = _core.malloc(n)
                ctypes.memmove(p, (p & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"), 8)
                mine.append((p, n))
        for p, n in mine:
            _core.free(p, n)

    before = arena.statistics()
    errors = run_threads(worker)
    assert not errors, errors[:3]
    after = arena.statistics()
    assert after.current_count == before.current_count and after.current_bytes == before.current_bytes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_child_falls_back_and_frees_inherited_blocks(arena):
    inherited = _core.malloc(4096)
    ctypes.memset(inherited, 7, 4096)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no CUDA, plain memory for new blocks
        ok = _core.is_forked_child() == 1
        ok &= ctypes.string_at(inherited, 4) == b"\x07" * 4
        _core.free(inherited, 4096)
        fresh = _core.malloc(1000)
        ok &= bool(fresh) and _core.lookup(fresh)[0] is None
        _core.free(fresh, 1000)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    assert _core.is_forked_child() == 0
    assert _core.lookup(inherited)[0] == "host"  # the parent's block is untouched
    _core.free(inherited, 4096)


def test_arenas_share_a_budget_per_kind_and_device():
    """The CuPy-side arenas of other GPUs each have their device's budget;
    arenas of one kind and device share one (devices 5 and 6: budgets no
    other test uses)."""
    first = _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, cupy_side=True, device=5)
    again = _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, cupy_side=True, device=5)
    sibling = _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, device=5)  # NumPy side, same budget
    other = _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, cupy_side=True, device=6)
    assert first.id == again.id and len({first.id, sibling.id, other.id}) == 3
    held = first.allocate(6 * MiB)
    try:
        with pytest.raises(_core.OutOfMemoryError):
            sibling.allocate(6 * MiB)  # the same budget: 12 MiB > 8 MiB
        elsewhere = other.allocate(6 * MiB)  # another device's budget: room
        other.deallocate(elsewhere)
        other.set_cap(16 * MiB)
        assert first.statistics().cap_bytes == 8 * MiB and other.statistics().cap_bytes == 16 * MiB
    finally:
        first.deallocate(held)
    for arena in (first, sibling, other):
        arena.trim()


def test_an_arena_with_a_context_must_take_cuda_memory():
    with pytest.raises(UmpError):
        _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, device=7, context=0x1234)
    with pytest.raises(UmpError):
        _core.Arena("host", _core.PROVIDER_HOST, 8 * MiB, device=-2)


def test_cap_trims_the_cached_chunks_of_every_arena_of_the_budget():
    """Past the cap, the wholly free chunks of both sides of a budget are
    given back when together they cover the shortfall, though neither side
    alone caches as much as the request (device 20: a budget no other test
    uses)."""
    numpy_side = _core.Arena("host", _core.PROVIDER_HOST, 6 * MiB, device=20)
    cupy_side = _core.Arena("host", _core.PROVIDER_HOST, 6 * MiB, cupy_side=True, device=20)
    for arena in (numpy_side, cupy_side):
        arena.trim()
    x, y, z = numpy_side.allocate(2 * MiB), cupy_side.allocate(2 * MiB), cupy_side.allocate(2 * MiB)
    numpy_side.deallocate(x)
    cupy_side.deallocate(y)  # 4 MiB cached, 2 in each arena; 2 MiB live; the cap is 6
    w = cupy_side.allocate(3 * MiB)  # short by 3 MiB: both arenas are trimmed
    assert numpy_side.statistics().held_bytes == 0 and numpy_side.statistics().chunk_frees >= 1
    cupy_side.deallocate(w)
    cupy_side.deallocate(z)
    # one arena: a cached 2 MiB slab and a 3 MiB request under a 4 MiB cap
    cupy_side.trim()
    cupy_side.set_cap(4 * MiB)
    cupy_side.deallocate(cupy_side.allocate(100))
    assert cupy_side.statistics().cached_bytes == 2 * MiB
    cupy_side.deallocate(cupy_side.allocate(3 * MiB))
    cupy_side.trim()


def test_cap_trims_nothing_that_could_not_make_room():
    """Trimming chunks that cannot cover the shortfall would only thrash the
    provider: the request fails and the cached chunk stays."""
    arena = _core.Arena("host", _core.PROVIDER_HOST, 4 * MiB, device=20)
    arena.trim()
    arena.deallocate(arena.allocate(100))  # a wholly free 2 MiB slab
    before = arena.statistics()
    with pytest.raises(_core.OutOfMemoryError, match="UMP_ERR_CAP"):
        arena.allocate(5 * MiB)  # short by 3 MiB, 2 MiB cached
    after = arena.statistics()
    assert (after.cached_bytes, after.chunk_frees) == (2 * MiB, before.chunk_frees)
    arena.trim()


def test_statistics_of_blocks_through_the_thread_cache():
    """Blocks served from this thread's cache count in the totals, and blocks
    waiting in it are not live for the peak (device 21: an arena of its own)."""
    arena = _core.Arena("host", _core.PROVIDER_HOST, 1 << 30, device=21)
    previous = _core.get_numpy_arena()
    _core.set_numpy_arena(arena.id)
    try:
        s0 = arena.statistics()
        for _ in range(10_000):
            _core.free(_core.malloc(64), 64)
        s1 = arena.statistics()
        assert s1.total_count - s0.total_count == 10_000
        assert s1.total_bytes - s0.total_bytes == 10_000 * 512
        assert s1.peak_count <= max(s0.peak_count, s0.current_count + 1)
        assert s0.peak_count == 0  # a new arena: its peak is this test's alone
        small = [_core.malloc(64) for _ in range(32)]  # 32 live 512-byte blocks
        for p in small:
            _core.free(p, 64)  # all 32 into this thread's cache
        large = [_core.malloc(1024) for _ in range(32)]  # 32 live again, not 64
        s2 = arena.statistics()
        assert (s2.current_count, s2.peak_count, s2.peak_bytes) == (32, 32, 32 * 1024)
        small = [_core.malloc(64) for _ in range(32)]  # from the cache: 64 live
        s3 = arena.statistics()
        assert (s3.current_count, s3.peak_count) == (64, 64)
        assert s3.total_count - s1.total_count == 96
        for p in small + large:
            _core.free(p, 0)
        s4 = arena.statistics()
        assert (s4.current_count, s4.current_bytes) == (0, 0)
    finally:
        _core.set_numpy_arena(previous)
        arena.trim()
