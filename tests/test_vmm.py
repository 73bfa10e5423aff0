"""The VMM pool's logic on its emulated physical layer (memfd mappings): the
same C code as on a GPU, minus the CUDA calls. Runs on every machine; the
tests on `any_pool` run on the GPU's physical layer too, where there is one.

What the GPU adds (CuPy, peer access, the driver's own memory accounting) is
in test_gpu_vmm.py.
"""

from __future__ import annotations

import ctypes
import os
import random

import pytest

import ump
from _fork import fork, wait
from _pools import device_pool, emulated_pool, fill, holds
from _threads import run_threads
from ump import _core
from ump._vmm import VMMPool

MiB = 1 << 20
GRAN = 2 * MiB


@pytest.fixture
def pool():
    yield from emulated_pool(8 << 30)


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=pytest.mark.gpu)])
def any_pool(request):
    """A pool on each physical layer: the emulation, and GPU 0's memory."""
    if request.param == "emulated":
        yield from emulated_pool(8 << 30)
    else:
        yield from device_pool(request.getfixturevalue("vmm_cupy"), 8 << 30)


def _fill(ptr, n, byte):
    ctypes.memset(ptr, byte, n)


def _check(ptr, n, byte):
    data = ctypes.string_at(ptr, n)
    return data == bytes([byte]) * n


def test_blocks_are_aligned_distinct_and_keep_their_data(pool):
    sizes = [1, 511, 512, 4097, MiB, 3 * MiB + 5, 17 * MiB]
    ptrs = [pool.allocate(n) for n in sizes]
    for i, (p, n) in enumerate(zip(ptrs, sizes)):
        assert p % 512 == 0
        _fill(p, n, i + 1)
    for i, (p, n) in enumerate(zip(ptrs, sizes)):
        assert _check(p, n, i + 1)
        assert ump.kind_of(p) == "host" and ump.kind_of(p + n - 1) == "host"
        assert _core.lookup(p + n // 2)[1:] == (p, (n + 511) // 512 * 512)
    st = pool.statistics()
    assert st.current_count == len(sizes)
    assert st.used_bytes == sum((n + 511) // 512 * 512 for n in sizes)
    for p in ptrs:
        pool.deallocate(p)
    assert pool.statistics().used_bytes == 0
    assert ump.kind_of(ptrs[0]) is None


def test_growth_maps_granules_and_large_requests_take_few_handles(pool):
    p = pool.allocate(64 * MiB)
    st = pool.statistics()
    assert st.mapped_bytes == 64 * MiB == st.physical_bytes
    # halving: 32 granules -> handles of 16, 8, 4, 2, 1, 1 granules
    assert st.handles == 6
    pool.deallocate(p)


def test_handles_are_reused_not_recreated(pool):
    ptrs = [pool.allocate(GRAN) for _ in range(8)]
    for p in ptrs:
        pool.deallocate(p)
    created = pool.statistics().handles_created
    assert pool.trim(keep_handles=True) == 16 * MiB  # unmapped, kept
    st = pool.statistics()
    assert st.mapped_bytes == 0 and st.cached_bytes == 16 * MiB
    again = [pool.allocate(GRAN) for _ in range(8)]
    st = pool.statistics()
    assert st.handles_created == created  # every mapping reused a cached handle
    assert st.mapped_bytes == 16 * MiB and st.cached_bytes == 0
    for p in again:
        pool.deallocate(p)


def _cache_one_granule_handles(pool, n):
    """Leave n cached (unmapped) handles of one granule each in the pool."""
    ptrs = [pool.allocate(GRAN) for _ in range(n)]  # one 1-granule handle each
    for p in ptrs:
        pool.deallocate(p)
    pool.trim(keep_handles=True)
    st = pool.statistics()
    assert st.handles == n and st.cached_bytes == n * GRAN and st.mapped_bytes == 0
    return st


def test_a_run_of_many_small_cached_handles(pool):
    """A run maps as many cached pieces as it needs: its undo log grows."""
    before = _cache_one_granule_handles(pool, 70)
    big = pool.allocate(70 * GRAN)
    st = pool.statistics()
    assert st.handles_created == before.handles_created  # all 70 reused, none created
    assert st.mapped_bytes == 70 * GRAN and st.cached_bytes == 0
    _fill(big, 70 * GRAN, 4)
    assert _check(big, 70 * GRAN, 4)
    pool.deallocate(big)


@pytest.mark.parametrize("after", [0, 40, 69, 70])
def test_a_long_run_failing_half_way_is_rolled_back(pool, after):
    """Fail the mapping of piece `after` of 70 (70: the set-access after
    them): every piece mapped before it is unmapped again, nothing leaks."""
    before = _cache_one_granule_handles(pool, 70)
    _core.fault_inject(after, 1)
    with pytest.raises(ump.OutOfMemoryError, match="UMP_ERR_INJECTED"):
        pool.allocate(70 * GRAN)
    _core.fault_inject(0, 0)
    st = pool.statistics()
    assert st.rollbacks == before.rollbacks + 1
    assert st.unmaps - before.unmaps == after
    assert (st.handles, st.handles_created, st.physical_bytes, st.cached_bytes) == (
        70, before.handles_created, 70 * GRAN, 70 * GRAN)
    assert (st.mapped_bytes, st.used_bytes) == (0, 0)
    big = pool.allocate(70 * GRAN)  # the same pieces serve it now
    assert pool.statistics().handles_created == before.handles_created
    pool.deallocate(big)


def test_trim_gives_back_everything_free(pool):
    keep = pool.allocate(GRAN)
    ptrs = [pool.allocate(n * MiB) for n in (3, 10, 33)]
    for p in ptrs:
        pool.deallocate(p)
    released = pool.trim()
    st = pool.statistics()
    assert released > 0
    # only the granules the live block touches stay
    assert st.physical_bytes <= 2 * GRAN and st.cached_bytes == 0
    assert _core.lookup(keep)[0] == "host"
    pool.deallocate(keep)
    pool.trim()
    assert pool.statistics().physical_bytes == 0


def test_idle_memory_is_moved_before_new_memory_is_created(pool):
    """Physical memory follows the live blocks, not the address range."""
    a = pool.allocate(32 * MiB)
    b = pool.allocate(MiB)  # pins the end of a's range: a's hole cannot merge with top
    pool.deallocate(a)
    c = pool.allocate(40 * MiB)  # does not fit in the 32 MiB hole: new addresses
    st = pool.statistics()
    assert c != a
    # a's handles were unmapped and remapped under c instead of new ones
    assert st.physical_bytes <= 44 * MiB
    assert st.unmaps > 0
    pool.deallocate(b)
    pool.deallocate(c)


def test_best_fit_and_merging(pool):
    a, b, c = (pool.allocate(MiB) for _ in range(3))
    assert (b, c) == (a + MiB, a + 2 * MiB)  # new blocks are cut from the top of the range
    pool.deallocate(a)
    pool.deallocate(b)
    ab = pool.allocate(2 * MiB)
    assert ab == a  # a and b merged into one free block, which fits exactly
    small = pool.allocate(4096)
    assert small == c + MiB  # no free block left: cut from the top, after c
    # Two holes, of 1 MiB (c's) and 3 MiB: a small block takes the smaller.
    d = pool.allocate(3 * MiB)
    pin = pool.allocate(4096)  # keeps d's hole from being the last block
    assert (d, pin) == (small + 4096, small + 4096 + 3 * MiB)
    pool.deallocate(d)
    pool.deallocate(c)
    tiny = pool.allocate(512)
    assert tiny == c
    # the rest of c's hole serves the next request that fits it, before d's
    rest = pool.allocate(MiB - 512)
    assert rest == c + 512
    big = pool.allocate(2 * MiB)
    assert big == d  # only d's hole fits
    for p in (ab, small, pin, tiny, rest, big):
        pool.deallocate(p)


def test_stream_order(pool):
    """A block freed on one stream is reused on that stream only."""
    a = pool.allocate(MiB, stream=1)
    pool.deallocate(a)
    b = pool.allocate(MiB, stream=2)
    assert b != a
    again = pool.allocate(MiB, stream=1)
    assert again == a
    pool.deallocate(b)
    pool.deallocate(again)


def test_limit(any_pool):
    pool = any_pool
    pool.set_limit(16 * MiB)
    p = pool.allocate(12 * MiB)
    fill(pool, p, 12 * MiB, 7)
    with pytest.raises(ump.OutOfMemoryError, match="limit 16777216"):
        pool.allocate(8 * MiB)
    assert holds(pool, p, 12 * MiB, 7)  # nothing lost
    pool.deallocate(p)
    q = pool.allocate(16 * MiB)  # the freed memory is reused under the limit
    assert pool.statistics().physical_bytes <= 16 * MiB
    pool.deallocate(q)
    pool.set_limit()  # no limit
    assert pool.get_limit() == 0


@pytest.mark.parametrize("after", [0, 1, 2, 3])
def test_a_failed_mapping_is_rolled_back(any_pool, after):
    """Fail the N-th step (create, map, ..., set-access) of a 3-handle mapping."""
    pool = any_pool
    keep = pool.allocate(MiB)
    fill(pool, keep, MiB, 9)
    before = pool.statistics()
    _core.fault_inject(after, 1)
    with pytest.raises(ump.OutOfMemoryError, match="UMP_ERR_INJECTED"):
        pool.allocate(7 * MiB)  # granules 0-3: 0 is mapped, 1-3 need handles
    _core.fault_inject(0, 0)
    st = pool.statistics()
    assert st.rollbacks == before.rollbacks + 1
    assert (st.physical_bytes, st.mapped_bytes, st.used_bytes) == (
        before.physical_bytes, before.mapped_bytes, before.used_bytes)
    # every handle created on the way was released again
    assert st.handles == before.handles
    assert st.handles_created - st.handles_released == before.handles_created - before.handles_released
    assert holds(pool, keep, MiB, 9)
    p = pool.allocate(7 * MiB)  # and the pool still works
    fill(pool, p, 7 * MiB, 1)
    assert holds(pool, p, 7 * MiB, 1)
    pool.deallocate(p)
    pool.deallocate(keep)


def test_fragmentation_workload_holds_little_more_than_it_uses(pool):
    """Mixed sizes (1 KiB - 64 MiB), random lifetimes, ~2 GiB live: the
    physical memory held at peak stays within 10 % of the bytes in use."""
    rng = random.Random(0)
    live, used, peak = [], 0, 0
    for _ in range(3000):
        if live and (rng.random() < 0.45 or used > 1 << 31):
            ptr, n = live.pop(rng.randrange(len(live)))
            pool.deallocate(ptr)
            used -= n
        else:
            n = (int(2 ** rng.uniform(10, 26)) + 511) // 512 * 512
            live.append((pool.allocate(n), n))
            used += n
            peak = max(peak, used)
    st = pool.statistics()
    assert st.peak_used_bytes == peak
    assert st.peak_physical_bytes / peak <= 1.10
    for ptr, _ in live:
        pool.deallocate(ptr)


def test_threads(pool):
    def work(seed):
        rng = random.Random(seed)
        live = []
        for _ in range(1500):
            if live and rng.random() < 0.5:
                p, n, tag = live.pop(rng.randrange(len(live)))
                assert _check(p, min(n, 4096), tag), "corrupted"
                pool.deallocate(p)
            else:
                n = rng.randrange(1, 3 * MiB)
                p = pool.allocate(n, stream=seed % 2)
                tag = rng.randrange(1, 255)
                _fill(p, min(n, 4096), tag)
                live.append((p, n, tag))
        for p, n, tag in live:
            pool.deallocate(p)

    errors = run_threads(work, n=6)
    assert not errors, errors
    st = pool.statistics()
    assert st.used_bytes == 0 and st.current_count == 0 and st.bad_frees == 0


def test_growable_buffer_keeps_its_address_and_data(pool):
    buf = pool.buffer(256 * MiB, 3 * MiB)
    ptr = buf.ptr
    _fill(ptr, 3 * MiB, 5)
    buf.resize(100 * MiB)
    assert buf.ptr == ptr and buf.size == 100 * MiB
    assert _check(ptr, 3 * MiB, 5)
    _fill(ptr + 99 * MiB, MiB, 6)
    assert ump.kind_of(ptr + 99 * MiB) == "host"
    assert pool.used_bytes() == 100 * MiB
    buf.resize(4 * MiB)  # shrinking unmaps whole handles past the end
    assert pool.statistics().mapped_bytes < 100 * MiB
    assert _check(ptr, 3 * MiB, 5)
    with pytest.raises(ValueError, match="max_bytes"):
        buf.resize(257 * MiB)
    buf.close()
    assert ump.kind_of(ptr) is None


def test_migrate_keeps_address_and_data(pool):
    p = pool.allocate(20 * MiB)
    _fill(p, 20 * MiB, 3)
    pool.migrate(p, 20 * MiB, 1)
    assert pool.device_of(p, 20 * MiB) == 1
    assert 1 in pool.devices
    assert _check(p, 20 * MiB, 3)
    assert ump.migrate(p, 0) == p  # back, through the public function
    assert pool.device_of(p, 20 * MiB) == 0 and _check(p, 20 * MiB, 3)
    pool.deallocate(p)


def test_bad_input(pool):
    p = pool.allocate(4096)
    with pytest.raises(ValueError, match="not a live block"):
        pool.deallocate(p + 512)
    pool.deallocate(p)
    with pytest.raises(ValueError, match="not a live block"):
        pool.deallocate(p)  # double free
    assert pool.statistics().bad_frees == 2
    with pytest.raises(ValueError, match="non-negative"):
        pool.allocate(-1)
    with pytest.raises(ump.OutOfMemoryError, match="reserved address range"):
        pool.allocate(1 << 40)
    with pytest.raises(ValueError, match="fraction"):
        pool.set_limit(fraction=1.5)
    with pytest.raises(ValueError, match="non-negative"):
        pool.set_limit(-5)
    with pytest.raises(ValueError, match="device"):
        pool.grant(-1)
    with pytest.raises(ValueError, match="reserve"):
        VMMPool(emulate=True, reserve=0)
    with pytest.raises(ValueError):
        pool.buffer(0)
    with pytest.raises(ump.UmpError, match="VMM pool"):
        ump.migrate(12345, 1)  # not pool memory
    with pytest.raises(TypeError):
        ump.migrate("garbage", 1)
    q = pool.allocate(10)
    with pytest.raises(ump.UmpError, match="live block"):
        pool.close()
    pool.deallocate(q)
    pool.close()
    assert ump.kind_of(q) is None
    pool.close()  # twice is fine


def test_a_destroyed_pools_id_is_a_stale_handle(pool):
    """Once its pool is destroyed, an id fails every call with UMP_ERR_HANDLE;
    an id no pool can have is a bad argument."""
    pool_id = pool.id
    pool.close()
    st = _core._CVmmStats()
    assert _core.vmm_alloc(pool_id, 512, 0) == 0 and _core.last_status() == _core.ERR_HANDLE
    assert _core.vmm_free(pool_id, 4096) == _core.ERR_HANDLE
    assert _core.vmm_stats(pool_id, ctypes.byref(st)) == _core.ERR_HANDLE
    assert _core.vmm_destroy(pool_id) == _core.ERR_HANDLE
    assert _core.vmm_stats(-1, ctypes.byref(st)) == _core.ERR_ARG
    assert _core.vmm_stats(2**31 - 1, ctypes.byref(st)) == _core.ERR_ARG
    # The next pool takes the freed slot under another id: the old id
    # still names nothing.
    again = VMMPool(emulate=True, reserve=8 << 30)
    try:
        assert again.id != pool_id and again.id % _core.MAX_POOLS == pool_id % _core.MAX_POOLS
        assert _core.vmm_stats(pool_id, ctypes.byref(st)) == _core.ERR_HANDLE
        ptr = again.allocate(4096)
        assert _core.lookup_owner(ptr)[3] == _core.MAX_ARENAS + again.id  # lookups name the new id
        again.deallocate(ptr)
    finally:
        again.close()


def test_a_pool_closed_under_a_call_says_so(pool):
    """Another thread's close() between this thread's check and its C call:
    the call names the closed pool, not an out-of-memory or a foreign block."""
    ptr = pool.allocate(4096)
    pool.deallocate(ptr)
    assert _core.vmm_destroy(pool._id) == 0  # as close() on another thread does
    with pytest.raises(ump.UmpError, match="the pool is closed") as err:
        pool.allocate(4096)
    assert err.value.cuda_error == "UMP_ERR_HANDLE"
    with pytest.raises(ump.UmpError, match="the pool is closed"):
        pool.deallocate(ptr)
    pool._closed = True  # what close() records


def test_a_free_block_at_the_end_grows_into_the_unused_range():
    """A free last block is not a wall: a request larger than it takes it and
    the never-used range behind it (on its stream), and a full range says so,
    not that the limit was reached."""
    p = VMMPool(emulate=True, reserve=64 * MiB)
    try:
        a = p.allocate(32 * MiB)
        p.deallocate(a)
        b = p.allocate(48 * MiB)  # the free 32 MiB at the end + 16 MiB never cut
        assert b == a
        with pytest.raises(ump.OutOfMemoryError, match="address range of 67108864 bytes has no "
                                                        "free 33554432 bytes") as err:
            p.allocate(32 * MiB)
        assert "limit" not in str(err.value) and err.value.cuda_error == "UMP_ERR_RANGE"
        p.deallocate(b)
        # Freed on stream 0, wanted on stream 1 and the range has no room
        # left: after the device-wide wait the whole range serves stream 1.
        c = p.allocate(64 * MiB, stream=1)
        assert c == a
        p.deallocate(c)
    finally:
        p.close()


def test_a_free_last_block_of_another_stream_does_not_grow():
    """Stream order: while the range has room, a block freed on stream 1 is
    not handed to stream 2, not even grown."""
    p = VMMPool(emulate=True, reserve=128 * MiB)
    try:
        a = p.allocate(32 * MiB, stream=1)
        p.deallocate(a)
        b = p.allocate(48 * MiB, stream=2)
        assert b == a + 32 * MiB
        c = p.allocate(40 * MiB, stream=1)  # nor does it grow over stream 2's block
        assert c == b + 48 * MiB
        for ptr in (b, c):
            p.deallocate(ptr)
    finally:
        p.close()


def test_sizes_that_wrap_around_the_address_space_are_refused(pool):
    """ctypes passes -1 as 2**64 - 1: ptr + size wraps, and the C walked its
    granule map far past its end."""
    a = pool.allocate(4 * MiB)  # the range's first block
    for bad in (-1, 0, 1.5, True):
        with pytest.raises(ValueError, match="size"):
            pool.device_of(a, bad)
        with pytest.raises(ValueError, match="size"):
            pool.migrate(a, bad, 0)
    for ptr, size in ((a, 2**64 - 1), (a + 4096, 2**64 - 4096), (a + GRAN, 2**64 - 1)):
        assert _core.vmm_device_of(pool.id, ptr, size, ctypes.byref(ctypes.c_int())) == _core.ERR_ARG
        assert _core.vmm_migrate(pool.id, ptr, size, 0) == _core.ERR_ARG
    assert pool.device_of(a, 4 * MiB) == 0  # what is right still answers
    pool.deallocate(a)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_cannot_allocate_from_its_parents_emulated_pool(pool):
    """The child's copy of the pool maps the parent's memfds (MAP_SHARED): a
    block it handed out, or a handle it moved, would be the parent's memory.
    It refuses, as a device pool's copy does; a pool the child makes works."""
    a = pool.allocate(GRAN)
    pool.deallocate(a)  # its granule stays mapped: a block there needs no mapping
    pid = fork()
    if pid == 0:
        code = 99
        try:
            failed = 0
            for i, call in enumerate([lambda: pool.allocate(4096), lambda: pool.allocate(64 * MiB),
                                      lambda: pool.ring(GRAN), lambda: pool.buffer(GRAN, GRAN),
                                      pool.trim]):
                try:
                    call()
                except ump.UmpError as err:
                    failed |= (err.cuda_error != "UMP_ERR_FORKED") << i
                else:
                    failed |= 1 << i
            own = VMMPool(emulate=True, reserve=64 * MiB)
            ptr = own.allocate(GRAN)
            ctypes.memset(ptr, 7, GRAN)
            failed |= (not _check(ptr, GRAN, 7)) << 5
            own.deallocate(ptr)
            own.close()
            code = failed
        finally:
            os._exit(code)
    assert wait(pid) == 0
    b = pool.allocate(4096)
    assert b == a  # the parent's pool is as it was
    pool.deallocate(b)
