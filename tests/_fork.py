"""fork() in a test, and the wait for the child, which never hangs the run."""

from __future__ import annotations

import os
import signal
import time
import warnings

#: What a child gets to finish: a child stuck on a lock it inherited held
#: must fail its test, not hang the suite.
CHILD_TIMEOUT = 20.0


def fork() -> int:
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a process with threads: that
        # is often the situation under test.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def wait(pid: int, timeout: float = CHILD_TIMEOUT) -> int | None:
    """The child's exit code, or None if it was still running after
    `timeout` (then it is killed and reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
