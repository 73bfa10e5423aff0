"""Turning ump on from outside a program: ``python -m ump run`` and the
pytest plugin share the settings read here (flags, then ``UMP_*``
environment variables)."""

from __future__ import annotations

import math
import os
import re
import runpy
import sys

__all__ = ["ENV_OPTIONS", "parse_size", "settings", "start", "run"]

#: Environment variables and the :func:`ump.enable` argument each sets.
ENV_OPTIONS = {
    "UMP_BACKEND": "backend",
    "UMP_CAP": "cap",
    "UMP_HEADROOM": "headroom",
    "UMP_PLACEMENT": "placement",
    "UMP_SYNC": "sync",
    "UMP_DEVICE": "device",
    "UMP_PREFETCH_MIN": "prefetch_min",
}

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int | float:
    """Bytes as an int (``"4294967296"``, ``"8e9"``, ``"4G"``, ``"512MiB"``:
    units are binary, ``G``, ``GB`` and ``GiB`` alike) or a fraction in
    (0, 1] as a float (``"0.5"``). A whole number is bytes: ``"1"`` is one
    byte.

    Raises
    ------
    ValueError
        ``text`` is neither.
    """
    text = str(text).strip()
    m = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", text, re.IGNORECASE)
    if m:
        return int(m.group(1)) * _UNITS[m.group(2).lower()]
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and not math.isfinite(value):
        value = None  # inf, nan, 1e400
    if value is not None and 0.0 < value <= 1.0:
        return value
    if value is not None and value > 1.0 and value == int(value):
        return int(value)  # 8e9
    raise ValueError(f"{text!r} is not a size (bytes such as 4G, 512MiB or 8e9) or a fraction "
                     "in (0, 1] (such as 0.5)")


def settings(flags: dict | None = None, environ=os.environ) -> tuple[str, dict]:
    """(backend, options) for :func:`ump.enable`: ``flags`` (None values
    ignored) over the ``UMP_*`` variables."""
    merged = {opt: environ[var] for var, opt in ENV_OPTIONS.items() if environ.get(var)}
    merged.update({k: v for k, v in (flags or {}).items() if v is not None})
    backend = merged.pop("backend", "auto")
    for key in ("cap", "headroom", "prefetch_min"):
        if isinstance(merged.get(key), str):
            merged[key] = parse_size(merged[key])
    if isinstance(merged.get("device"), str):
        try:
            merged["device"] = int(merged["device"])
        except ValueError:
            raise ValueError(f"device must be a device index, got {merged['device']!r}") from None
    return backend, merged


def start(backend: str, options: dict) -> str:
    """Enable ump for a program started from outside it.

    It sets ``UMP_LAUNCHED=1``, not ``CUPY_ENABLE_UMP=1``: child processes
    (``subprocess``, ``multiprocessing``) inherit it, so those that call
    :func:`ump.enable` (Dask workers with ump's plugin) need no variable
    either, while in those that do not, CuPy's own UMP path, which asserts
    on GPUs without HMM/ATS, stays off. A ``CUPY_ENABLE_UMP`` already in the
    environment stays as it is.
    """
    import ump

    from ._enable import LAUNCHED

    os.environ[LAUNCHED] = "1"
    return ump.enable(backend, **options)


def run(*, script: str | None = None, module: str | None = None, args=()) -> None:
    """Run ``script`` or ``module`` as ``__main__`` with ``args`` as its
    command line, as ``python script.py`` or ``python -m`` would."""
    # sys.path[0] as Python sets it: the current directory for -m, the
    # script's directory for a script.
    if module is not None:
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
