"""The option table: every option of :func:`ump.enable`, declared once.

Each field of :class:`Options` carries its parser, its check and its help
text. From them come the ``UMP_*`` environment variables, the flags of
``python -m ump run``, the pytest plugin's ``--ump-*`` flags and the Dask
preload's ``--ump-*`` options, so every entry point takes the same values
(``enable(cap="4G")`` as ``UMP_CAP=4G``) and a new option reaches all of
them. Pure Python: the pytest plugin reads it without loading the C core.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable

__all__ = ["Option", "Options", "TABLE", "BACKEND", "BACKENDS", "PLACEMENTS", "SYNCS", "min_cap", "argparse_type",
           "parse_size", "resolve"]

#: The backends' names, in the order ``python -m ump info`` lists them
#: (``ump.backends`` has one module per name).
BACKENDS = ("system", "managed", "pinned", "device", "host")
PLACEMENTS = ("auto", "host", "migrate")
SYNCS = ("device", "stream")

# Units as dask.utils.parse_bytes reads them: k, kB = 1000; ki, kiB = 1024.
_PREFIXES = "kmgtp"
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate(_PREFIXES, 1):
    _UNITS.update({_p: 1000 ** _i, _p + "b": 1000 ** _i, _p + "i": 1024 ** _i, _p + "ib": 1024 ** _i})
del _i, _p
_SIZE = re.compile(r"([0-9]*\.?[0-9]*(?:e[+-]?[0-9]+)?)([a-z]*)", re.IGNORECASE)


def parse_size(text: str) -> int | float:
    """Bytes as an int, or a fraction in (0, 1] as a float.

    Units are read as Dask reads them (``dask.utils.parse_bytes``): SI
    ``k``/``kB``, ``M``/``MB``, ``G``/``GB``, ... are powers of 1000, binary
    ``Ki``/``KiB``, ``Mi``/``MiB``, ``Gi``/``GiB``, ... powers of 1024:
    ``"4G"`` is 4 000 000 000 bytes, ``"4GiB"`` 4 294 967 296. A number
    without a unit is bytes when it is whole (``"4096"``, ``"8e9"``; ``"1"``
    is one byte) and a fraction when it is in (0, 1] (``"0.5"``, ``"1.0"``).

    Raises
    ------
    ValueError
        ``text`` is neither.
    """
    text = str(text)
    m = _SIZE.fullmatch(text.replace(" ", ""))
    if m and m.group(2).lower() in _UNITS:
        number, unit = m.group(1), _UNITS[m.group(2).lower()]
        if not number and m.group(2):
            return unit  # "MB": one of the unit, as Dask reads it
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            if number.isdigit():
                return int(number) * unit  # exactly, past a double's precision too
            if m.group(2):
                return int(value * unit)  # 1.5GiB
            if 0.0 < value <= 1.0:
                return value
            if value > 1.0 and value == int(value):
                return int(value)  # 8e9
    raise ValueError(f"{text!r} is not a size (bytes such as 4G, 512MiB or 8e9) or a fraction "
                     "in (0, 1] (such as 0.5)")


def _parse_index(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a device index (0, 1, ...)") from None


def _parse_text(text: str) -> str:
    return text


def check_device_index(device, name: str = "device") -> int:
    """``device`` if it is a non-negative int; else ValueError naming it."""
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"{name} must be a non-negative int, got {device!r}")
    return device


def check_budget(name: str, value, minimum: int = 0, why: str = ""):
    """``value`` if it is bytes (an int from ``minimum`` to 2**63) or a
    fraction (a float in (0, 1]); else TypeError/ValueError naming ``name``.
    The one check of ``enable(cap=...)`` and ``VMMPool(limit=...)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int (bytes) or a float fraction, not {type(value).__name__}")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"{name} as a fraction must be in (0, 1], got {value}")
    if isinstance(value, int) and not minimum <= value < 1 << 63:
        bounds = f"from {minimum} to 2**63" if minimum else "non-negative, below 2**63"
        raise ValueError(f"{name} must be a number of bytes {bounds}, got {value}{why}")
    return value


def _check_index(name, value):
    return check_device_index(value, name)


def min_cap() -> int:
    """The smallest cap: one chunk of an arena (csrc/ump.h, UMP_CHUNK_MIN),
    read from the C core when a cap is checked, so reading the table loads
    no extension."""
    from . import _ucore

    return _ucore.UMP_CHUNK_MIN


def _check_cap(name, value):
    if value is None:
        return None
    return check_budget(name, value, min_cap(), " (one chunk at least: a smaller cap would send every "
                                              "array to plain memory)")


def _check_bytes(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"{name} must be a non-negative int (bytes), got {value!r}")
    return value


def _choice(choices):
    def check(name, value):
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    return check


@dataclasses.dataclass(frozen=True)
class Option:
    """One option, as every entry point reads it.

    ``parse`` reads the text of a flag or variable; ``check`` takes the name
    to report and a value (parsed, or given to :func:`ump.enable`) and
    returns it or raises ValueError/TypeError naming it. ``examples`` are
    texts with the value each means, ``refused`` texts every entry point
    refuses: the tests drive every entry point with both.
    """

    name: str
    default: Any
    parse: Callable[[str], Any]
    check: Callable[[str, Any], Any]
    help: str
    metavar: str
    examples: tuple[tuple[str, Any], ...]
    refused: tuple[str, ...]
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        """Its environment variable: ``UMP_CAP``."""
        return "UMP_" + self.name.upper()

    def flag(self, prefix: str = "--") -> str:
        """Its command-line flag: ``--cap``; ``--ump-cap`` with ``prefix="--ump-"``."""
        return prefix + self.name.replace("_", "-")

    def describe(self) -> str:
        """Its help, with its values and its variable."""
        values = f": {', '.join(self.choices)}" if self.choices else ""
        return f"{self.help}{values}; env {self.env}"

    def convert(self, value, name: str | None = None):
        """``value`` as :func:`ump.enable` takes it: text is parsed first.
        Errors name ``name`` (the flag or variable), else the option."""
        name = name or self.name
        if isinstance(value, str):
            try:
                value = self.parse(value)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        return self.check(name, value)


def argparse_type(option: Option):
    """``option`` as argparse's (and pytest's) ``type=``: text parsed and
    checked; an error is an ArgumentTypeError, which argparse reports after
    the flag's name."""
    import argparse

    def convert(text):
        try:
            return option.check(option.name, option.parse(text))
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = option.name
    return convert


def _option(default, **spec):
    """A field of :class:`Options` with its row of the table."""
    return dataclasses.field(default=default, metadata={"option": spec})


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of :func:`enable` (pass them as keyword arguments).

    Every option also takes text, as on a command line: ``cap="4G"``,
    ``device="1"`` (see :func:`parse_size` for sizes).

    Parameters
    ----------
    cap : int or float, optional
        Most bytes the backend may hold, NumPy's and CuPy's side together
        (with ``device``: the pinned arena and the VMM pool each): an
        int is bytes (at least one chunk, 2 MiB), a float in (0, 1] a fraction
        of the device's free memory at ``enable()`` (of the host's available
        memory for ``host``). Default: the budget of docs/backends.md — the
        device's free memory less ``headroom`` for memory the GPU holds
        (``managed``, ``device``), and no more than three quarters of the
        host's available memory for host memory (``pinned``, ``system``,
        ``host``). Past it NumPy gets plain host memory; CuPy gets plain
        device memory where the backend's memory is host memory (``pinned``,
        ``system``), else raises :class:`ump.OutOfMemoryError`.
    headroom : int, optional
        Device memory left to the CUDA libraries and other processes (bytes);
        default the larger of 512 MiB and 1/64 of the device's memory.
    device : int
        The CUDA device whose primary context and memory ump uses (0).
    placement : {"auto", "host", "migrate"}
        Where managed NumPy arrays live when handed to CuPy: ``"host"`` keeps
        them in host memory, mapped by the GPU; ``"migrate"`` prefetches them
        to the GPU at every hand-off; ``"auto"`` starts like ``"host"``,
        migrates a block at its hand-offs once the GPU time spent on it over
        the link exceeded what migrating it there and back would have cost,
        and leaves on the GPU a block that CuPy keeps while the host reads a
        little of it at each export (docs/backends.md).
    prefetch_min : int
        Blocks smaller than this (bytes, default 2 MiB) are never migrated;
        ``get()`` and ``cupy.asnumpy`` copy the arrays CuPy made in managed
        memory that span less than this, instead of sharing them.
    sync : {"device", "stream"}
        What a host export waits for: every kernel of the device (default;
        CuPy does not record which stream wrote an array), or only the stream
        passed to ``get(stream=...)``.

    Raises
    ------
    ValueError, TypeError
        A value the option does not take; the message names the option.
    """

    cap: int | float | None = _option(
        None, parse=parse_size, check=_check_cap, metavar="SIZE",
        help="most memory ump holds: bytes (4G, 512MiB) or a fraction in (0, 1] of free device memory "
             "(0.5); default: the device's free memory less the headroom, at most 3/4 of the host's",
        examples=(("4GiB", 4 << 30), ("8G", 8 * 10**9), ("512MiB", 512 << 20), ("0.5", 0.5)),
        refused=("lots", "1", "0", "inf", "1.5"))
    headroom: int | None = _option(
        None, parse=parse_size, check=_check_bytes, metavar="SIZE",
        help="device memory left to CUDA libraries and other processes (bytes, 1GiB); "
             "default: 512MiB or 1/64 of the device, whichever is larger",
        examples=(("1GiB", 1 << 30), ("0", 0)), refused=("0.5", "some"))
    device: int = _option(
        0, parse=_parse_index, check=_check_index, metavar="INDEX",
        help="the CUDA device whose memory ump uses",
        examples=(("0", 0), ("1", 1)), refused=("one", "-1"))
    placement: str = _option(
        "auto", parse=_parse_text, check=_choice(PLACEMENTS), metavar="MODE", choices=PLACEMENTS,
        help="where managed NumPy arrays live when handed to CuPy",
        examples=(("host", "host"), ("migrate", "migrate")), refused=("gpu",))
    prefetch_min: int = _option(
        2 << 20, parse=parse_size, check=_check_bytes, metavar="SIZE",
        help="smallest block ever migrated (bytes, 2MiB)",
        examples=(("4MiB", 4 << 20), ("1M", 10**6)), refused=("0.5", "-1"))
    sync: str = _option(
        "device", parse=_parse_text, check=_choice(SYNCS), metavar="WHAT", choices=SYNCS,
        help="what a host export waits for: the device, or the stream given to get()",
        examples=(("stream", "stream"), ("device", "device")), refused=("never",))

    def __post_init__(self):
        for option in TABLE.values():
            if option.name != "backend":
                object.__setattr__(self, option.name, option.convert(getattr(self, option.name)))


#: ``backend`` is :func:`ump.enable`'s first argument, not an :class:`Options`
#: field, but every entry point takes it like one.
BACKEND = Option(
    "backend", "auto", _parse_text, _choice(("auto", *BACKENDS)), metavar="NAME", choices=("auto", *BACKENDS),
    help="the backend; auto picks the best this machine runs",
    examples=(("host", "host"), ("auto", "auto")), refused=("gpu",))

#: Every option by name: ``backend``, then :class:`Options`' fields in order.
TABLE: dict[str, Option] = {"backend": BACKEND}
TABLE.update({f.name: Option(f.name, f.default, **f.metadata["option"]) for f in dataclasses.fields(Options)})


def resolve(flags: dict | None = None, environ=os.environ) -> tuple[str, dict]:
    """(backend, options) for :func:`ump.enable`: ``flags`` (converted
    values; None: not given) over the ``UMP_*`` variables.

    Raises
    ------
    ValueError, TypeError
        A variable's value that its option refuses; the message names the
        variable.
    """
    merged = {}
    for option in TABLE.values():
        text = environ.get(option.env)
        if text:
            merged[option.name] = option.convert(text, option.env)
    merged.update({k: v for k, v in (flags or {}).items() if v is not None})
    return merged.pop("backend", "auto"), merged


def markdown() -> str:
    """The table as docs/guide.md shows it."""
    lines = ["| option | variable | `run` | pytest | Dask preload | default | what it sets |",
             "|---|---|---|---|---|---|---|"]
    for option in TABLE.values():
        default = option.default
        if option.parse is parse_size and isinstance(default, int):
            default = f"{default >> 20}MiB"
        default = "see its text" if default is None else f"`{default}`"
        pytest_flag = "--ump[=NAME]" if option is BACKEND else option.flag("--ump-")
        values = f" ({', '.join(option.choices)})" if option.choices else ""
        lines.append(f"| `{option.name}` | `{option.env}` | `{option.flag()}` | `{pytest_flag}` | "
                     f"`{option.flag('--ump-')}` | {default} | {option.help}{values} |")
    return "\n".join(lines)
