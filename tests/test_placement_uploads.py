"""The placement's uploads and the watch on CuPy's allocations, with the
stand-in GPU clock of test_placement.py: a block handed over that only
CuPy's view holds moves at the next allocation; one the program holds is
asked about for a few allocations only; the watch goes off once nothing
needs it, whichever of an allocation or a wait ends the questions."""

from __future__ import annotations

import numpy
from test_placement import BASE, GiB, MiB, FakeCupy, FakeLease, Watch, _policy, _sync, moves  # noqa: F401 (a fixture)

from ump import _placement


def _watched_policy(cupy):
    policy = _policy(cupy)
    policy.watch = Watch()
    return policy, policy.watch


def test_an_upload_only_cupy_holds_moves_at_the_next_allocation(moves):
    """``x = cupy.asarray(x)``: the program let go of the NumPy array; the
    next kernel's output allocation moves it, before any wait."""
    cupy = FakeCupy()
    policy, watch = _watched_policy(cupy)
    lease = FakeLease(numpy.ones(4))
    policy.on_handoff("managed", BASE, GiB, lease)
    assert watch.on and moves == []
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)
    assert moves == [(GiB, 0)] and policy.state(BASE, GiB).synced
    assert not policy.uploads and not watch.on  # nothing more to ask


def _upload_the_program_holds():
    """A NumPy array the program still holds, handed to CuPy: (the policy,
    its watch, the array, its lease)."""
    policy, watch = _watched_policy(FakeCupy())
    held = numpy.ones(4)
    lease = FakeLease(held)
    policy.on_handoff("managed", BASE, GiB, lease)
    return policy, watch, held, lease


def test_an_array_the_program_holds_is_asked_about_a_few_allocations_only(moves):
    policy, watch, held, lease = _upload_the_program_holds()
    for _ in range(_placement.HOLD_CHECKS):
        policy.on_cupy_malloc(BASE + 2 * GiB, MiB)
    assert moves == [] and not policy.uploads and not watch.on
    assert (BASE, GiB) in policy.pending  # the waits still decide
    del held
    policy.on_handoff("managed", BASE, GiB, lease)  # handed over again: asked again
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)
    assert moves == [(GiB, 0)]


def test_an_upload_moved_at_a_wait_switches_the_watch_off(moves):
    """A block the program still holds, moved at a wait before its few
    allocations of questions ran out: nothing needs the watch any more, so
    CuPy's allocations go straight to its pool again, not through the
    policy's Python on each one for the rest of the process."""
    policy, watch, held, lease = _upload_the_program_holds()
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)
    assert watch.on and policy.uploads  # still asked about
    _sync(policy, policy.cupy, 5.0)  # heavy kernels on it, then another array's read
    assert moves == [(GiB, 0)] and not policy.pending
    assert not policy.uploads and not watch.on


def test_an_upload_whose_view_is_gone_switches_the_watch_off(moves):
    """CuPy dropped its view before the questions ran out: the wait that
    finds it gone stops following the block and the watch with it."""
    policy, watch, held, lease = _upload_the_program_holds()
    del lease  # the view's owner: no kernel can reach the block anew
    _sync(policy, policy.cupy, 0.001)
    assert moves == [] and not policy.pending and not policy.uploads and not watch.on


def test_an_upload_the_program_lets_go_of_later_moves_then(moves):
    policy, watch, held, lease = _upload_the_program_holds()
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)
    assert moves == []
    del held
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)
    assert moves == [(GiB, 0)]


def test_an_upload_whose_work_did_not_pay_is_weighed_in_full_next_time(moves):
    """A program loading one array after another into the same memory, one
    pass each: the first upload moves, its work does not pay for the way
    back its memory takes (NumPy's next writes fault it back), so later
    uploads of that block stay on the host."""
    cupy = FakeCupy()
    policy, watch = _watched_policy(cupy)
    for step in range(3):
        lease = FakeLease(numpy.ones(4))  # numpy.load(f): only CuPy holds it
        policy.on_handoff("managed", BASE, GiB, lease)
        policy.on_cupy_malloc(BASE + 2 * GiB, MiB)  # the pass's output
        _sync(policy, cupy, 0.026)  # one pass, read as a scalar
        del lease
    assert moves == [(GiB, 0)]  # the first upload only
    assert not policy.state(BASE, GiB).eager and not policy.state(BASE, GiB).heavy


def test_a_move_that_fails_leaves_the_wait_and_the_allocation_alone(monkeypatch):
    def refuse(*args):
        raise _placement.UmpError("prefetching", "CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(_placement._core, "prefetch", refuse)
    cupy = FakeCupy()
    policy, watch = _watched_policy(cupy)
    lease = FakeLease(numpy.ones(4))
    policy.on_handoff("managed", BASE, GiB, lease)
    policy.on_cupy_malloc(BASE + 2 * GiB, MiB)  # the upload's move fails: no exception
    _sync(policy, cupy, 5.0)
    assert policy.state(BASE, GiB).on_gpu is None
