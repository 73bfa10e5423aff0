"""Progress of a bench run, inside each configuration's process too.

A configuration's worker prints its results on stdout, which the run reads
at the end; as it goes it says on stderr when it starts and ends each suite
(:func:`report`). :func:`run_worker` reads those lines as they come and
:class:`Progress` shows them with an estimate of the time left: a tqdm bar
on a terminal where tqdm is installed (``pip install ump-unified-memory[bench]``),
else one plain line per suite.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

__all__ = ["Progress", "report", "run_worker", "suites_in"]

_MARK = "ump-bench-progress:"


def suites_in(config: str, suites, config_free) -> list[str]:
    """The suites a configuration's process runs: those that set up their own
    configurations (``config_free``: they measure ump's own code) run only in
    "imported"."""
    return [s for s in suites if s not in config_free or config == "imported"]


def report(event: str, suite: str) -> None:
    """Worker side: ``event`` ("start" or "done") of ``suite``."""
    print(f"{_MARK}{event} {suite}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class Progress:
    """The suites of a run, (configuration, suite) in the order they run,
    with an ETA from the suites' times so far: a suite takes about as long
    in every configuration, and suites differ a lot from each other."""

    def __init__(self, plan: list[tuple[str, str]], stream=sys.stderr):
        self.plan = list(plan)
        self.stream = stream
        self.done = 0
        self.times: dict[str, list[float]] = {}
        self.started = time.perf_counter()
        self._suite_start = None  # while a suite runs: when it started
        self._bar = None
        if getattr(stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=len(self.plan), file=stream, unit="suite", dynamic_ncols=True,
                                 bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def left(self) -> float | None:
        """Seconds left, from the suites' mean times; None before any suite ended."""
        if not self.times:
            return None
        mean_all = statistics.mean(t for times in self.times.values() for t in times)
        todo = sum(statistics.mean(self.times.get(suite, [mean_all])) for _, suite in self.plan[self.done:])
        running = time.perf_counter() - self._suite_start if self._suite_start is not None else 0.0
        return max(todo - running, 0.0)

    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def start(self, config: str, suite: str) -> None:
        left = self.left()
        self._suite_start = time.perf_counter()
        eta = f", about {_duration(left)} left" if left is not None else ""
        if self._bar is not None:
            self._bar.set_description(f"{config}: {suite}")
            self._bar.set_postfix_str(eta.lstrip(", "))
        else:
            self.say(f"  {config}: {suite} (suite {self.done + 1}/{len(self.plan)}, "
                     f"{_duration(time.perf_counter() - self.started)} so far{eta})")

    def end(self, config: str, suite: str) -> None:
        if self._suite_start is not None:
            self.times.setdefault(suite, []).append(time.perf_counter() - self._suite_start)
        self._suite_start = None
        self.done = min(self.done + 1, len(self.plan))
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_worker(cmd, config: str, progress: Progress, **kwargs) -> subprocess.CompletedProcess:
    """Run a configuration's worker like ``subprocess.run(capture_output=True)``,
    showing its suites on ``progress`` as they start and end; the returned
    stderr has the worker's other lines."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        out = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        err = []
        for line in proc.stderr:
            if line.startswith(_MARK):
                event, _, suite = line[len(_MARK):].strip().partition(" ")
                (progress.start if event == "start" else progress.end)(config, suite)
            else:
                err.append(line)
        reader.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out), "".join(err))
