"""Run a function in several threads at once and collect what they raised."""

from __future__ import annotations

import threading


def run_threads(fn, n: int = 8) -> list[BaseException]:
    """Call ``fn(i)`` for i in range(n), each in its own thread; return the
    exceptions raised (empty when every call succeeded)."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def call(i):
        try:
            fn(i)
        except BaseException as err:  # reported to the test, not lost in the thread
            with lock:
                errors.append(err)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def warm_numpy_random() -> None:
    """numpy.random keeps a small array alive after its first use in a
    thread; make that happen before a test takes its baseline."""
    import numpy as np

    run_threads(lambda i: np.random.default_rng(i).random(), n=1)
