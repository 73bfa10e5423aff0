"""``python -m ump bench`` as a user runs it, and what a bad argument gets."""

from __future__ import annotations

import subprocess
import sys


def bench_cli(tmp_path, *args):
    """``python -m ump bench ARGS`` in tmp_path, where no source tree shadows
    the installed ump."""
    return subprocess.run([sys.executable, "-m", "ump", "bench", *args], capture_output=True, text=True,
                          cwd=tmp_path)


def usage_error(run) -> str:
    """What a bad argument gets, as argparse does it: the usage, then one
    line; exit status 2, no traceback."""
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert run.stderr.startswith("usage: python -m ump bench ") and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.strip().splitlines() if not line.startswith((" ", "usage:"))]
    assert len(lines) == 1 and lines[0].startswith("python -m ump bench: error: "), run.stderr
    assert "[1/" not in run.stderr  # nothing ran
    return lines[0]
