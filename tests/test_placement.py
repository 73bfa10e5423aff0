"""The placement policy's decisions, on the CPU: a stand-in for the CuPy calls it makes (events
on a GPU clock the test advances, the free memory, the stream) and for the prefetch, which records
where each block was sent. What the moves cost on a GPU is in docs/backends.md; the GPU test of
the policy is tests/test_gpu_unified.py."""

from __future__ import annotations

import types

import numpy
import pytest

from ump import _placement

GiB = 1 << 30
MiB = 1 << 20
BASE = 0x7F0000000000


class FakeCupy:
    """The calls Placement makes, on a GPU clock that `work` advances."""

    def __init__(self, free=64 * GiB):
        self.clock = 0.0  # seconds of GPU work queued so far
        self.free = free
        self.capturing = False  # the current stream captures a CUDA graph
        self.stream_waits = 0
        self.device = 0  # the current device
        self.entered = []  # devices made current with `with cuda.Device(d)`
        self.busy = set()  # streams with work still queued (None: the current one)
        fake = self

        class Device:
            def __init__(self, device):
                self.device = device

            def __enter__(self):
                self.before, fake.device = fake.device, self.device
                fake.entered.append(self.device)

            def __exit__(self, *exc):
                fake.device = self.before

        class Event:
            def record(self, stream=None):
                self.at = fake.clock
                self.stream = stream

            @property
            def done(self):
                return self.stream not in fake.busy

            def synchronize(self):
                pass

        class Stream:
            ptr = 1234

            def synchronize(self):
                fake.stream_waits += 1

        runtime = types.SimpleNamespace(getDevice=lambda: fake.device,
                                        memGetInfo=lambda: (fake.free, 80 * GiB),
                                        streamIsCapturing=lambda ptr: fake.capturing)
        self.cuda = types.SimpleNamespace(
            Event=Event, Device=Device, runtime=runtime, get_current_stream=lambda: Stream(),
            get_elapsed_time=self._elapsed_time)

    @staticmethod
    def _elapsed_time(start, end):
        if not (start.done and end.done):
            raise RuntimeError("cudaErrorNotReady")  # as CuPy raises it
        return (end.at - start.at) * 1e3

    def work(self, seconds):
        self.clock += seconds


def _record(monkeypatch, call: str, what):
    """Replace the CUDA call ``_core.<call>`` with a list of ``what(*args)`` for each call made."""
    made = []
    monkeypatch.setattr(_placement._core, call, lambda *args: made.append(what(*args)))
    return made


@pytest.fixture
def moves(monkeypatch):
    """Every prefetch the policy issues: (size, device), -1 for the host."""
    return _record(monkeypatch, "prefetch", lambda base, size, device, stream: (size, device))


def _policy(cupy, mode="auto"):
    options = types.SimpleNamespace(placement=mode, prefetch_min=2 * MiB)
    return _placement.Placement(cupy, options, headroom=GiB)


def _step(policy, cupy, size, seconds, waited=None, base=BASE):
    """Kernels costing `seconds` of GPU time, then a host export of the block
    at `base` that waited for them (all of them unless `waited` says
    otherwise)."""
    cupy.work(seconds)
    policy.on_host_export("managed", base, size, seconds if waited is None else waited)


def test_round_trips_learn_to_migrate_once_the_gpu_time_beats_a_migration(moves):
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.05)  # below 0.13 s per GiB there and back
    assert moves == [] and not policy.state(BASE, GiB).heavy
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.26)  # ten kernels over the link
    assert moves == [] and policy.state(BASE, GiB).heavy
    policy.on_handoff("managed", BASE, GiB)  # the next round trip: there ...
    assert moves == [(GiB, 0)]
    _step(policy, cupy, GiB, 0.05)  # ... and back at the export, waited for
    assert moves == [(GiB, 0), (GiB, -1)] and cupy.stream_waits == 1


def test_each_move_is_logged_at_debug_to_the_ump_placement_logger(moves, caplog):
    cupy = FakeCupy()
    policy = _policy(cupy)
    caplog.set_level("DEBUG", logger="ump.placement")
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.26)
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.05)
    assert moves == [(GiB, 0), (GiB, -1)]
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ump.placement", "DEBUG", f"block {BASE:#x} ({GiB} bytes) to GPU 0"),
        ("ump.placement", "DEBUG", f"block {BASE:#x} ({GiB} bytes) back to the host")]
    # formatted by logging, when a handler takes the record: not by the policy
    assert caplog.records[0].msg == "block %#x (%d bytes) to GPU %d" and caplog.records[0].args == (BASE, GiB, 0)


def _heavy(policy, cupy, size):
    """Make the block at BASE heavy: a round trip of ten kernels over the link."""
    policy.on_handoff("managed", BASE, size)
    _step(policy, cupy, size, 0.26 * size / GiB)
    assert policy.state(BASE, size).heavy


def test_a_heavy_block_whose_work_shrinks_is_host_resident_again(moves):
    cupy = FakeCupy()
    policy = _policy(cupy)
    _heavy(policy, cupy, GiB)
    for _ in range(2):  # ten kernels in HBM: over the link they would cost 0.26 s
        policy.on_handoff("managed", BASE, GiB)
        _step(policy, cupy, GiB, 0.0128)
    assert policy.state(BASE, GiB).heavy and moves == [(GiB, 0), (GiB, -1)] * 2
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.0013)  # one kernel: 26 ms over the link, under half a migration
    assert not policy.state(BASE, GiB).heavy and moves == [(GiB, 0), (GiB, -1)] * 3
    policy.on_handoff("managed", BASE, GiB)  # the next round trip stays on the host
    _step(policy, cupy, GiB, 0.026)
    assert moves == [(GiB, 0), (GiB, -1)] * 3 and not policy.state(BASE, GiB).heavy
    policy.on_handoff("managed", BASE, GiB)  # and the work grows again: heavy again
    _step(policy, cupy, GiB, 0.26)
    policy.on_handoff("managed", BASE, GiB)
    assert policy.state(BASE, GiB).heavy and moves == [(GiB, 0), (GiB, -1)] * 3 + [(GiB, 0)]


def test_a_new_block_of_a_heavy_blocks_size_starts_heavy_until_one_of_that_size_is_not(moves):
    """A loop that makes its next array before it drops the last hands over
    two blocks in turn: the second learns from the first's verdict."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    other = BASE + 2 * GiB
    _heavy(policy, cupy, GiB)
    policy.on_handoff("managed", other, GiB)  # never seen: moved at once
    assert policy.state(other, GiB).heavy and moves == [(GiB, 0)]
    _step(policy, cupy, GiB, 0.0128, base=other)  # its ten kernels in HBM
    assert moves == [(GiB, 0), (GiB, -1)] and policy.state(other, GiB).heavy
    policy.on_handoff("managed", BASE + 4 * GiB, GiB // 2)  # another size learns on its own
    assert moves == [(GiB, 0), (GiB, -1)] and not policy.state(BASE + 4 * GiB, GiB // 2).heavy
    policy.on_handoff("managed", other, GiB)
    _step(policy, cupy, GiB, 0.0013, base=other)  # one kernel: the work shrank, not heavy any more
    assert not policy.state(other, GiB).heavy
    policy.on_handoff("managed", BASE + 6 * GiB, GiB)  # so a new block of that size starts on the host
    assert not policy.state(BASE + 6 * GiB, GiB).heavy and moves == [(GiB, 0), (GiB, -1)] * 2


def test_a_block_seen_before_without_a_verdict_takes_its_sizes(moves):
    """Blocks that carried single passes earlier (no verdict: too little
    work says nothing of the next array) take on the verdict of a block of
    their size; a block with a verdict of its own keeps it."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    other, single = BASE + 2 * GiB, BASE + 4 * GiB
    for base in (BASE, other, single):
        policy.on_handoff("managed", base, GiB)
        _step(policy, cupy, GiB, 0.026, base=base)  # a single pass over the link
    policy.on_handoff("managed", single, GiB)  # shrunk once heavy: a verdict of its own
    _step(policy, cupy, GiB, 0.26, base=single)
    policy.on_handoff("managed", single, GiB)
    _step(policy, cupy, GiB, 0.0013, base=single)
    assert not policy.state(single, GiB).heavy and moves == [(GiB, 0), (GiB, -1)]
    _heavy(policy, cupy, GiB)
    policy.on_handoff("managed", other, GiB)  # no verdict of its own: moved at once
    assert moves == [(GiB, 0), (GiB, -1), (GiB, 0)]
    _step(policy, cupy, GiB, 0.0128, base=other)
    policy.on_handoff("managed", single, GiB)  # its own verdict stands
    assert moves == [(GiB, 0), (GiB, -1)] * 2 and not policy.state(single, GiB).heavy


def test_a_heavy_block_is_timed_from_the_end_of_its_migration(moves, monkeypatch):
    """The prefetch to the GPU is not the block's work: on the GPU's clock it
    runs before the event the export measures from."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    _heavy(policy, cupy, GiB)
    monkeypatch.setattr(_placement._core, "prefetch",
                        lambda base, size, device, stream: (moves.append((size, device)), cupy.work(0.022)))
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.0013)
    assert not policy.state(BASE, GiB).heavy


def test_gpu_idle_time_keeps_a_heavy_block_heavy(moves):
    """Time on the GPU's clock not capped by the host's wait: a host that
    compiled or dispatched between the hand-off and the export overstates
    the work, and the block stays as it was."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    _heavy(policy, cupy, GiB)
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.1, waited=0.0013)
    assert policy.state(BASE, GiB).heavy


def test_gpu_time_counts_no_more_than_the_host_waited_since_the_hand_off(moves):
    """The program's own waits count (``Stream.synchronize()``), waits before the hand-off not."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, GiB)
    _step(policy, cupy, GiB, 0.5, waited=0.01)  # the GPU worked while the host was busy
    assert not policy.state(BASE, GiB).heavy
    policy.on_sync(0, 0.5, None, 1.0)  # other work's, before the next hand-off
    for waited, heavy in ((0.0, False), (0.26, True)):
        policy.on_handoff("managed", BASE, GiB)
        cupy.work(0.26)  # ten kernels over the link, then the program's own wait for them, or none
        policy.on_sync(0, waited, None, 2.0 + waited)
        policy.on_handoff("managed", BASE, GiB)  # handed over again: the first hand-off's event counts
        _step(policy, cupy, GiB, 0.0, waited=0.0)  # the export finds the GPU idle
        assert policy.state(BASE, GiB).heavy is heavy and moves == []


def test_a_peek_loop_migrates_at_the_second_export_and_stays(moves):
    size = 256 * MiB  # one way: 5.5 ms; two kernels over the link: 13 ms
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, size)
    _step(policy, cupy, size, 0.013)
    assert moves == []  # right after a hand-off the host may read it all
    _step(policy, cupy, size, 0.013)  # a second export, no hand-off between
    assert moves == [(size, 0)]
    _step(policy, cupy, size, 0.0065)  # holds the migration: no verdict
    for _ in range(5):
        _step(policy, cupy, size, 0.0005)  # kernels in HBM, the host peeks
    assert moves == [(size, 0)] and policy.state(BASE, size).peeked
    policy.on_handoff("managed", BASE, size)  # the next loop starts on the GPU
    assert moves == [(size, 0)] * 2  # again: the host may have written it since
    _step(policy, cupy, size, 0.0005)
    assert moves == [(size, 0)] * 2  # not brought back: a peeked block stays


def test_a_peeked_block_handed_over_again_goes_to_the_gpu_at_once(moves):
    size = 256 * MiB
    cupy = FakeCupy()
    policy = _policy(cupy)
    # peeked in a loop of 20 exports
    state = policy.blocks[(BASE, size)] = _placement.BlockState(peeked=True, host_seconds=0.013, exports=20)
    policy.on_handoff("managed", BASE, size)
    assert moves == [(size, 0)] and state.moved
    _step(policy, cupy, size, 0.006)  # the move's interval: no verdict
    _step(policy, cupy, size, 0.0005)
    assert moves == [(size, 0)] and state.peeked


def test_a_loop_whose_host_reads_much_goes_back_to_the_host(moves):
    size = 256 * MiB
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, size)
    _step(policy, cupy, size, 0.013)
    _step(policy, cupy, size, 0.013)
    assert moves == [(size, 0)]
    _step(policy, cupy, size, 0.007)
    _step(policy, cupy, size, 0.010)  # the kernels fault back what the host read
    assert moves == [(size, 0), (size, -1)]
    state = policy.state(BASE, size)
    assert state.on_gpu is None and state.stay_host and not state.peeked
    for _ in range(3):
        _step(policy, cupy, size, 0.013)
    assert moves == [(size, 0), (size, -1)]  # host-resident until the next hand-off


def test_a_migration_that_does_not_fit_is_not_made(moves):
    size = 256 * MiB
    cupy = FakeCupy(free=size)  # less the 1 GiB headroom: no room
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, size)
    for _ in range(4):
        _step(policy, cupy, size, 0.013)
    assert moves == [] and policy.state(BASE, size).on_gpu is None


def test_exports_without_gpu_work_move_nothing(moves):
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, GiB)
    for _ in range(50):
        _step(policy, cupy, GiB, 0.00001)  # cupy.asnumpy again and again
    assert moves == []


def test_an_export_without_a_wait_learns_nothing(moves):
    size = 256 * MiB
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, size)
    for _ in range(4):
        cupy.work(0.013)
        policy.on_host_export("managed", BASE, size, None)  # get(blocking=False)
    assert moves == [] and policy.state(BASE, size).host_seconds is None


def test_fixed_modes(moves):
    cupy = FakeCupy()
    host = _policy(cupy, "host")
    host.on_handoff("managed", BASE, GiB)
    _step(host, cupy, GiB, 1.0)
    assert moves == [] and host.state(BASE, GiB) is None
    migrate = _policy(cupy, "migrate")
    for _ in range(2):
        migrate.on_handoff("managed", BASE, GiB)
        _step(migrate, cupy, GiB, 0.001)
        _step(migrate, cupy, GiB, 0.001)
    assert moves == [(GiB, 0), (GiB, -1)] * 2


def test_small_blocks_and_other_kinds_are_left_alone(moves):
    cupy = FakeCupy()
    policy = _policy(cupy, "migrate")
    policy.on_handoff("managed", BASE, MiB)  # below prefetch_min
    policy.on_handoff("pinned", BASE + GiB, GiB)
    assert moves == [] and not policy.blocks


def test_a_peeked_block_used_in_round_trips_is_measured_as_one_again(moves):
    """After one round trip (a single export: the host may have read it all),
    the next hand-off neither migrates it at once nor leaves it on the GPU."""
    size = 256 * MiB
    cupy = FakeCupy()
    policy = _policy(cupy)
    state = policy.blocks[(BASE, size)] = _placement.BlockState(peeked=True, host_seconds=0.013, exports=20)
    policy.on_handoff("managed", BASE, size)  # still known as peeked: on the GPU at once
    _step(policy, cupy, size, 0.002)  # one export, then a hand-off: a round trip
    assert moves == [(size, 0)]
    policy.on_handoff("managed", BASE, size)
    assert not state.peeked and moves == [(size, 0)]
    _step(policy, cupy, size, 0.002)  # brought back at the export: the host reads it whole
    assert moves == [(size, 0), (size, -1)]
    policy.on_handoff("managed", BASE, size)
    assert moves == [(size, 0), (size, -1)]  # host-resident: little GPU work, not heavy


def test_only_the_hand_off_measurement_makes_a_block_heavy(moves):
    """A peek loop whose kernels are bound by compute (the GPU time does not
    drop on the GPU) goes back to the host, and its long intervals between
    exports do not make it heavy: round trips stay host-resident."""
    size = 256 * MiB
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, size)
    _step(policy, cupy, size, 0.013)
    _step(policy, cupy, size, 0.040)  # past a migration there and back (33 ms), between exports
    _step(policy, cupy, size, 0.040)  # the interval that paid for the move
    _step(policy, cupy, size, 0.040)  # no faster on the GPU: back to the host
    state = policy.state(BASE, size)
    assert moves == [(size, 0), (size, -1)] and state.stay_host and not state.heavy
    policy.on_handoff("managed", BASE, size)
    assert moves == [(size, 0), (size, -1)]


def test_a_hand_off_while_a_graph_is_captured_records_nothing_and_moves_nothing(moves):
    # An event recorded then would be captured into the graph (nothing to
    # time), and a prefetch would invalidate the capture.
    cupy = FakeCupy()
    policy = _policy(cupy, "migrate")
    cupy.capturing = True
    policy.on_handoff("managed", BASE, GiB)
    assert moves == [] and policy.state(BASE, GiB) is None
    cupy.capturing = False
    policy.on_handoff("managed", BASE, GiB)
    assert moves == [(GiB, 0)]


# --- results the host reads back (CuPy's own blocks) --------------------------

PREFERRED_HOST, ACCESSED_BY_0 = (3, -1), (5, 0)
UNSET = [(4, -1), (6, 0)]


@pytest.fixture
def advice(monkeypatch):
    """Every cuMemAdvise the policy makes: (code, device)."""
    return _record(monkeypatch, "advise", lambda base, size, code, device: (code, device))


class Watch:
    """The switch of the watch on CuPy's allocations, as CupyHook gives it."""

    def __init__(self, available=True):
        self.on, self.available, self.calls = False, available, []

    def __call__(self, on):
        self.calls.append(on)
        self.on = on and self.available
        return self.on


def _results_policy(mode="auto", watch=None):
    cupy = FakeCupy()
    policy = _policy(cupy, mode)
    policy.watch = Watch() if watch is None else watch
    now = [0.0]
    policy.clock = lambda: now[0]
    return policy, now


def _result(policy, now, size, waited, lo=BASE, hi=None, device=0):
    """CuPy made the array on `device`, the host waited `waited` at its export."""
    now[0] += waited
    policy.on_result_export(BASE, size, lo, BASE + size if hi is None else hi, device, waited)


def test_a_result_the_gpu_faults_back_is_mapped_in_host_memory_and_stays(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.083)  # the first life: fresh pages, nothing known
    assert advice == [] and policy.returning == {(BASE, GiB): 0}  # read once: back at the next allocation
    _result(policy, now, GiB, 0.103)  # the next write faulted what the host read back
    assert advice == [PREFERRED_HOST, ACCESSED_BY_0] and policy.watch.on
    for _ in range(5):  # the loop goes on: the same array, written over the link
        policy.on_cupy_malloc(BASE, GiB)
        _result(policy, now, GiB, 0.021)
    assert advice == [PREFERRED_HOST, ACCESSED_BY_0] and moves == []
    assert policy.results[(BASE, GiB)].host_mapped and policy.watch.on


def test_a_host_mapped_result_not_twice_as_fast_goes_back_to_the_gpu_for_good(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)
    for life, waited in enumerate((0.06, 0.02, 0.04, 0.3, 0.3)):  # one slow life passes, not two
        policy.on_cupy_malloc(BASE, GiB)
        _result(policy, now, GiB, waited)
        _result(policy, now, GiB, 1e-5)  # the same array read again: the same life
        assert bool(policy.mapped) == policy.watch.on == (life < 4), life
    assert advice == [PREFERRED_HOST, ACCESSED_BY_0] + UNSET and moves == [(GiB, 0)]
    for _ in range(3):
        _result(policy, now, GiB, 0.1)
    assert len(advice) == 4 and moves == [(GiB, 0)]  # tried once


@pytest.mark.parametrize("ptr, size", [(BASE, 64 * MiB), (BASE + 512 * MiB, 64 * MiB), (BASE - MiB, 2 * MiB)])
def test_another_array_in_a_host_mapped_results_memory_puts_it_back_on_the_gpu(moves, advice, ptr, size):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)
    policy.on_cupy_malloc(BASE + 2 * GiB, 64 * MiB)  # elsewhere: nothing to do
    assert moves == [] and policy.mapped
    policy.on_cupy_malloc(ptr, size)  # CuPy's pool gave part of it to another array
    assert advice[2:] == UNSET and moves == [(GiB, 0)] and not policy.watch.on


def test_a_host_mapped_array_living_longer_than_the_loops_goes_back_to_the_gpu(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)
    policy.on_cupy_malloc(BASE, GiB)
    _result(policy, now, GiB, 0.02)  # a life of 20 ms
    policy.on_cupy_malloc(BASE, GiB)  # the same array again ...
    now[0] += 0.15
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)  # ... still alive: not yet twice the 0.1 s
    assert moves == []
    now[0] += 0.1
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)  # 0.25 s: its kernels are not the loop's
    assert advice[2:] == UNSET and moves == [(GiB, 0)]


def test_results_stay_on_the_gpu_without_the_evidence(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.5)  # one export: nothing repeats yet
    big = BASE + 4 * GiB
    for _ in range(5):  # kernels in HBM and a peek: less than a move one way each time
        now[0] += 0.003
        policy.on_result_export(big, GiB, big, big + GiB, 0, 0.003)
    _result(policy, now, GiB, 0.5, lo=BASE + 4096)  # an array inside the block, not the block
    _result(policy, now, GiB, 0.5, hi=BASE + GiB // 4)
    policy.on_result_export(BASE, GiB, BASE, BASE + GiB, 0, None)  # no wait: nothing measured
    assert advice == [] and moves == []
    small = BASE + 8 * GiB
    for _ in range(3):
        policy.on_result_export(small, MiB, small, small + MiB, 0, 0.5)  # below prefetch_min
    assert advice == [] and not policy.results.get((small, MiB))


@pytest.mark.parametrize("mode", ["host", "migrate"])
def test_fixed_modes_leave_results_on_the_gpu(moves, advice, mode):
    policy, now = _results_policy(mode)
    for _ in range(3):
        _result(policy, now, GiB, 0.1)
    assert advice == [] and moves == []


def test_without_the_watch_results_stay_on_the_gpu(moves, advice):
    # An allocator the program set itself: ump cannot see CuPy's pool
    # hand the memory to another array, so it never maps it in host memory.
    policy, now = _results_policy(watch=Watch(available=False))
    for _ in range(3):
        _result(policy, now, GiB, 0.1)
    assert advice == [] and not policy.mapped


def test_disable_puts_host_mapped_results_back_on_the_gpu(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)
    policy.close()
    assert advice[2:] == UNSET and moves == [(GiB, 0)] and not policy.watch.on


def test_advice_the_driver_refuses_leaves_the_result_on_the_gpu(moves, monkeypatch):
    def refuse(base, size, code, device):
        raise _placement.UmpError("advising", "CUDA_ERROR_INVALID_DEVICE")

    monkeypatch.setattr(_placement._core, "advise", refuse)
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)  # the export itself goes on
    assert not policy.mapped and policy.results[(BASE, GiB)].retired and not policy.watch.on


def test_a_result_on_another_gpu_is_mapped_for_that_gpu_and_moved_back_there(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1, device=1)
    _result(policy, now, GiB, 0.1, device=1)
    assert advice == [PREFERRED_HOST, (5, 1)]
    policy.on_cupy_malloc(BASE, 64 * MiB)  # on device 0, into that block's memory
    assert advice[2:] == [(4, -1), (6, 1)] and moves == [(GiB, 1)]
    assert policy.cupy.entered == [1]  # its free memory and stream are device 1's


def test_a_host_mapped_block_given_back_to_the_arena_goes_back_to_the_gpu(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)
    policy.on_block_freed(BASE + GiB)  # another block
    assert policy.mapped
    policy.on_block_freed(BASE)  # CuPy's pool let go of it (free_all_blocks)
    assert advice[2:] == UNSET and moves == [(GiB, 0)] and not policy.results and not policy.watch.on


def test_allocations_during_a_graph_capture_move_nothing(moves, advice):
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)
    policy.cupy.capturing = True
    policy.on_cupy_malloc(BASE, 64 * MiB)  # a prefetch would invalidate the capture
    assert moves == [] and policy.mapped
    policy.cupy.capturing = False
    policy.on_cupy_malloc(BASE, 64 * MiB)  # the next allocation after it
    assert moves == [(GiB, 0)] and not policy.mapped


def test_a_cuda_error_while_moving_back_does_not_fail_the_allocation(advice, monkeypatch):
    def refuse(base, size, device, stream):
        raise RuntimeError("cudaErrorInvalidValue")  # as CuPy's CUDARuntimeError

    monkeypatch.setattr(_placement._core, "prefetch", refuse)
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.1)
    _result(policy, now, GiB, 0.1)
    policy.on_cupy_malloc(BASE, 64 * MiB)
    assert advice[2:] == UNSET and not policy.mapped and not policy.watch.on


def test_an_export_that_waited_for_another_stream_than_the_hand_offs_measures_nothing(moves):
    # sync="stream": the host waited for the export's stream; the stream of
    # the hand-off still has work queued, so its event has not completed.
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, GiB)  # its event on the current stream
    cupy.work(0.26)
    cupy.busy.add(None)
    other = types.SimpleNamespace(ptr=99, synchronize=lambda: None)
    policy.on_host_export("managed", BASE, GiB, 0.26, other)
    assert not policy.state(BASE, GiB).heavy and moves == []
    cupy.busy.clear()
    policy.on_handoff("managed", BASE, GiB)  # measured as usual once the stream is idle
    _step(policy, cupy, GiB, 0.26)
    assert policy.state(BASE, GiB).heavy


def test_an_export_while_a_graph_is_captured_records_and_moves_nothing(moves):
    # get(stream=other) with sync="stream" is allowed while the current
    # stream captures: an event recorded on it, or a wait, would break it.
    cupy = FakeCupy()
    policy = _policy(cupy)
    _heavy(policy, cupy, GiB)
    policy.on_handoff("managed", BASE, GiB)
    assert moves == [(GiB, 0)]
    cupy.capturing = True
    cupy.work(0.05)
    policy.on_host_export("managed", BASE, GiB, 0.05)
    state = policy.state(BASE, GiB)
    assert moves == [(GiB, 0)] and cupy.stream_waits == 0 and state.exports == 0
    cupy.capturing = False
    policy.on_host_export("managed", BASE, GiB, 0.05)  # after the capture: back as usual
    assert moves == [(GiB, 0), (GiB, -1)] and state.exports == 1


def test_two_threads_exporting_one_block_take_turns_while_other_blocks_go_on(moves):
    # A second export of the block starts while the first waits for its end
    # event: it must find the block's state as the first leaves it, not
    # half-updated. Another block's hand-off meanwhile does not wait.
    import threading
    import time

    cupy = FakeCupy()
    policy = _policy(cupy)
    errors, other = [], []

    def export():
        try:
            policy.on_host_export("managed", BASE, GiB, 0.26)
        except Exception as err:  # noqa: BLE001 - the test reports it below
            errors.append(err)

    second = threading.Thread(target=export)
    synchronize = cupy.cuda.Event.synchronize

    def while_the_first_waits(event):
        if second.ident is None:
            second.start()
            deadline = time.monotonic() + 1.0
            while policy.state(BASE, GiB).exports < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # the second export, unless it waits its turn
            handoff = threading.Thread(target=lambda: other.append(
                policy.on_handoff("managed", BASE + 2 * GiB, GiB)))
            handoff.start()
            handoff.join(2)
            other.append(handoff.is_alive())  # still waiting for the first export?
        synchronize(event)

    cupy.cuda.Event.synchronize = while_the_first_waits
    policy.on_handoff("managed", BASE, GiB)
    cupy.work(0.26)
    export()
    second.join(5)
    assert not second.is_alive() and errors == [] and other == [None, False]
    assert policy.state(BASE, GiB).heavy and policy.state(BASE, GiB).exports == 2
    assert policy.state(BASE + 2 * GiB, GiB) is not None


# --- work between other arrays' reads ------------------------------------------

class FakeLease:
    """The owner of CuPy's view: holds the NumPy array while the view lives."""

    __slots__ = ("array", "__weakref__")

    def __init__(self, array):
        self.array = array


def _sync(policy, cupy, seconds, device=0, exclude=None):
    """Kernels costing `seconds`, then a read of another array that waited for them."""
    cupy.work(seconds)
    policy.on_sync(device, seconds, exclude)


def _handed_over():
    """A block handed to CuPy, whose view the program holds: (CuPy, the policy, the view's lease)."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    lease = FakeLease([0])
    policy.on_handoff("managed", BASE, GiB, lease)
    return cupy, policy, lease


HELD_COST = _placement.ONE_WAY_SECONDS_PER_BYTE + _placement.HOST_FAULTS_SECONDS_PER_BYTE


def test_a_block_read_by_kernels_between_other_arrays_reads_moves_once_the_loss_beats_its_cost(moves):
    """A solver's matrix: handed over once, then kernels and scalar reads of
    other arrays. The program still holds the NumPy array, so the host may
    fault it back: the loss must beat one way plus the host's faults."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    a = [0]  # the NumPy array, held by the program
    lease = FakeLease(a)
    policy.on_handoff("managed", BASE, GiB, lease)
    steps = 0
    while not moves:
        _sync(policy, cupy, 0.01)
        steps += 1
    lost = steps * 0.01 * (1 - 1 / _placement.LINK_OVER_HBM)
    assert lost > HELD_COST * GiB > lost - 0.01  # the first read past the cost moved it
    assert moves == [(GiB, 0)] and policy.state(BASE, GiB).on_gpu == 0
    _sync(policy, cupy, 1.0)
    assert moves == [(GiB, 0)]  # once
    del lease


def test_a_block_only_cupys_view_holds_moves_once_the_loss_beats_one_way(moves):
    """``x = cupy.asarray(x)``: the host can reach the memory only through
    an export, which brings it back: one way is all the migration costs."""
    import numpy

    cupy = FakeCupy()
    policy = _policy(cupy)
    lease = FakeLease(numpy.ones(4))  # nothing else holds the array
    policy.on_handoff("managed", BASE, GiB, lease)
    _sync(policy, cupy, 0.02)  # 19 ms lost: under one way (22 ms)
    assert moves == []
    _sync(policy, cupy, 0.01)
    assert moves == [(GiB, 0)]


def test_a_single_pass_and_its_own_export_do_not_move_the_block(moves):
    cupy = FakeCupy()
    policy = _policy(cupy)
    held = [0]
    policy.on_handoff("managed", BASE, GiB, FakeLease(held))
    lease = FakeLease(held)
    policy.on_handoff("managed", BASE, GiB, lease)
    _sync(policy, cupy, 0.026)  # one kernel over the link, read by a scalar of another array
    cupy.work(0.026)
    policy.on_sync(0, 0.5, exclude=(BASE, GiB))  # the block's own export decides, not this wait
    policy.on_host_export("managed", BASE, GiB, 0.5)
    _sync(policy, cupy, 5.0)  # exported: with the host now
    assert moves == [] and policy.state(BASE, GiB).on_gpu is None


def test_a_block_whose_view_died_or_on_another_device_is_not_moved(moves):
    cupy, policy, lease = _handed_over()
    _sync(policy, cupy, 5.0, device=1)  # another GPU's work
    assert moves == []
    del lease  # CuPy dropped its view
    _sync(policy, cupy, 5.0)
    assert moves == [] and not policy.pending


def test_every_hand_off_starts_the_count_over(moves):
    """A program handing the array over anew each step (stock CuPy copies it
    each time) pays at most one interval's work over the link."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    held = [0]
    for _ in range(10):
        lease = FakeLease(held)
        policy.on_handoff("managed", BASE, GiB, lease)
        _sync(policy, cupy, 0.1)  # under the cost each time
    assert moves == []


def test_a_block_moved_between_reads_comes_back_at_its_export_and_is_heavy(moves):
    cupy, policy, lease = _handed_over()
    _sync(policy, cupy, 0.3)
    assert moves == [(GiB, 0)]
    policy.on_host_export("managed", BASE, GiB, 0.01)
    assert moves == [(GiB, 0), (GiB, -1)] and policy.state(BASE, GiB).heavy
    policy.on_handoff("managed", BASE, GiB, lease)  # the next round trip migrates at once
    assert moves[-1] == (GiB, 0)


def test_moves_between_reads_need_auto_room_and_no_capture(moves):
    held = [0]
    for mode in ("host", "migrate"):
        cupy = FakeCupy()
        policy = _policy(cupy, mode)
        lease = FakeLease(held)
        policy.on_handoff("managed", BASE, GiB, lease)
        before = list(moves)
        _sync(policy, cupy, 5.0)
        assert moves == before and not policy.pending
    moves.clear()
    cupy = FakeCupy(free=GiB)  # no room beside the headroom
    policy = _policy(cupy)
    lease = FakeLease(held)
    policy.on_handoff("managed", BASE, GiB, lease)
    _sync(policy, cupy, 5.0)
    assert moves == [] and policy.state(BASE, GiB).on_gpu is None
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_handoff("managed", BASE, GiB, lease)
    cupy.capturing = True
    _sync(policy, cupy, 5.0)
    assert moves == []
    cupy.capturing = False
    _sync(policy, cupy, 0.001)  # the next wait decides
    assert moves == [(GiB, 0)]


def test_a_result_read_once_goes_back_to_its_gpu_at_the_next_allocation(moves, advice):
    """Black-Scholes' shape: CuPy makes arrays, the host reads them through
    an export, then kernels read them again: one prefetch back instead of a
    fault per page the host read. Once per block; an allocation that reuses
    the block leaves it to the rules for results."""
    policy, now = _results_policy()
    _result(policy, now, GiB, 0.01, device=1)
    assert policy.watch.on and moves == []
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)  # the next kernel's output
    assert moves == [(GiB, 1)] and not policy.returning and not policy.watch.on
    _result(policy, now, GiB, 0.01, device=1)  # exported again: the loop's rules decide
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)
    assert moves == [(GiB, 1)]
    other = BASE + 4 * GiB
    policy.on_result_export(other, GiB, other, other + GiB, 0, 0.01)
    policy.on_cupy_malloc(other, 64 * MiB)  # CuPy's pool reuses it: nothing to bring back
    assert moves == [(GiB, 1)] and not policy.returning
    policy.on_result_export(BASE + 8 * GiB, GiB, BASE + 8 * GiB, BASE + 9 * GiB, 0, 0.01)
    policy.on_block_freed(BASE + 8 * GiB)  # back to the arena
    assert not policy.returning


def test_a_block_whose_move_paid_moves_at_its_next_hand_off(moves):
    """CuPy's cg example makes a new matrix for each of its trials, often in
    the same block: the first trial's work paid for the move there and back,
    so the next trials' hand-offs move it at once, before any step reads it
    over the link."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    held = numpy.ones(4)
    lease = FakeLease(held)
    policy.on_handoff("managed", BASE, GiB, lease)
    _sync(policy, cupy, 0.3)
    assert moves == [(GiB, 0)]
    for trial in (2, 3):
        lease = FakeLease(held)
        policy.on_handoff("managed", BASE, GiB, lease)
        assert moves == [(GiB, 0)] * trial and (BASE, GiB) not in policy.pending
        assert policy.state(BASE, GiB).heavy
        _sync(policy, cupy, 1.0)


def test_waits_of_several_threads_at_once_count_once():
    cupy = FakeCupy()
    policy = _policy(cupy)
    policy.on_sync(0, 0.10, ended=10.00)
    policy.on_sync(0, 0.10, ended=10.05)  # overlapping the first by 0.05 s
    policy.on_sync(0, 0.02, ended=10.03)  # inside both
    policy.on_sync(1, 0.10, ended=10.05)  # another device's
    assert policy.waits[0] == pytest.approx(0.15) and policy.waits[1] == pytest.approx(0.10)


class _Lease:
    __slots__ = ("array", "__weakref__")


def test_only_cupys_view_holding_the_array_is_told_by_reference_counts():
    """The program holding the array, a view of it, or its base, keeps it
    the program's; dropping every such reference leaves it CuPy's alone."""
    lease = _Lease()
    big = numpy.ones((8, 8))
    lease.array = big[:, :4]  # cupy.asarray(big[:, :4])
    assert not _placement.only_view_holds(lease)  # the program holds the base
    del big
    assert _placement.only_view_holds(lease)
    a = numpy.ones(16)
    lease.array = a
    other = a[2:]  # a sibling view keeps the base alive
    assert not _placement.only_view_holds(lease)
    del other
    assert not _placement.only_view_holds(lease)  # the name a still holds it
    del a
    assert _placement.only_view_holds(lease)
    lease.array = numpy.frombuffer(bytearray(64))  # memory NumPy does not own
    assert not _placement.only_view_holds(lease)

def test_a_heavy_block_handed_over_again_without_an_export_is_judged_by_the_waits(moves):
    """A loop that rewrites its array on the host and hands it over each
    step, with no export: while each step's GPU work pays, every hand-off
    moves the block; once it shrinks, the block stays on the host."""
    cupy = FakeCupy()
    policy = _policy(cupy)
    held = numpy.ones(4)
    lease = FakeLease(held)  # CuPy's view, alive while the step runs
    policy.on_handoff("managed", BASE, GiB, lease)
    _sync(policy, cupy, 0.3)  # moved between reads: paid
    for _ in range(3):
        lease = FakeLease(held)
        policy.on_handoff("managed", BASE, GiB, lease)
        _sync(policy, cupy, 0.1)  # in HBM: 0.1 s x 20 still beats half a move there and back
    assert moves == [(GiB, 0)] * 4 and policy.state(BASE, GiB).heavy
    lease = FakeLease(held)
    policy.on_handoff("managed", BASE, GiB, lease)
    _sync(policy, cupy, 0.001)  # the work shrank
    lease = FakeLease(held)
    policy.on_handoff("managed", BASE, GiB, lease)  # judged here: host-resident again
    assert moves == [(GiB, 0)] * 5 and not policy.state(BASE, GiB).heavy
    assert (BASE, GiB) in policy.pending
