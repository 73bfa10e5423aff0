"""The option table (ump/_options.py): every option reaches every entry point
with the same values. The cases are generated from the table, so an option
added to it is tested at every entry point without a line here."""

from __future__ import annotations

import dataclasses

import pytest

import ump
from ump import _enable, _options
from ump._options import BACKEND, TABLE, Options, parse_size

pytest_plugins = ["pytester"]

ACCEPTED = [pytest.param(o, text, value, id=f"{o.name}={text}") for o in TABLE.values() for text, value in o.examples]
REFUSED = [pytest.param(o, text, id=f"{o.name}={text}") for o in TABLE.values() for text in o.refused]


class _Stop(Exception):
    """enable() got as far as probing the machine: its arguments were accepted."""


@pytest.fixture
def clean_env(monkeypatch):
    for option in TABLE.values():
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)  # the plugin would split the budget
    return monkeypatch


@pytest.fixture
def record_enable(clean_env):
    """ump.enable as the launcher and the plugin call it: records (backend, options)."""
    calls = []

    def enable(backend="auto", **options):
        calls.append((backend, Options(**options)))
        return backend

    clean_env.setattr(ump, "enable", enable)
    return calls


def _expected(option, value):
    return (value, Options()) if option is BACKEND else ("auto", Options(**{option.name: value}))


# --- the entry points, each given one option's text as a flag or in its variable ---

def _enable_call(option, text, monkeypatch):
    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(_enable, "probe", stop)
    seen = []
    real = _enable._as_options
    monkeypatch.setattr(_enable, "_as_options", lambda options: seen.append(real(options)) or seen[-1])
    args, kwargs = ((text,), {}) if option is BACKEND else ((), {option.name: text})
    with pytest.raises(_Stop):
        _enable.enable(*args, **kwargs)
    return (text if option is BACKEND else "auto"), seen[0]


def _run(option, text, env, calls, monkeypatch, tmp_path):
    from ump import __main__, _launch

    script = tmp_path / "prog.py"
    script.write_text("raise SystemExit('the program must not run')\n")
    monkeypatch.setattr(_launch, "start", lambda backend, options: calls.append((backend, Options(**options))))
    monkeypatch.setattr(_launch, "run", lambda **kwargs: None)
    if env:
        monkeypatch.setenv(option.env, text)
    __main__.main(["run", *([] if env else [option.flag(), text]), str(script)])
    return calls[-1]


def _pytest(option, text, env, calls, monkeypatch, pytester):
    if env:
        monkeypatch.setenv(option.env, text)
        args = ["--ump"]
    else:
        args = [f"--ump={text}"] if option is BACKEND else ["--ump", f"{option.flag('--ump-')}={text}"]
    # The project's own pytest settings leave pytest-benchmark out where it
    # is installed (it warns under xdist); the inner session does the same.
    pytester.parseconfigure("-p", "no:benchmark", "-p", "ump.pytest_plugin", *args)
    return calls[-1]


def _dask(option, text, env, monkeypatch):
    pytest.importorskip("distributed", reason="the Dask preload needs distributed (pip install dask)")
    import ump.dask as ump_dask
    if env:
        monkeypatch.setenv(option.env, text)
    ctx = ump_dask.dask_setup.make_context("dask_setup", [] if env else [option.flag("--ump-"), text])
    plugin = ump_dask._plugin(**ctx.params)
    return plugin.backend, Options(**plugin.options)


ENTRY_POINTS = ["enable()", "run flag", "run env", "pytest flag", "pytest env", "dask flag", "dask env"]


def _through(entry, option, text, calls, monkeypatch, tmp_path, request):
    kind, _, source = entry.partition(" ")
    env = source == "env"
    if kind == "enable()":
        return _enable_call(option, text, monkeypatch)
    if kind == "run":
        return _run(option, text, env, calls, monkeypatch, tmp_path)
    if kind == "pytest":
        return _pytest(option, text, env, calls, monkeypatch, request.getfixturevalue("pytester"))
    return _dask(option, text, env, monkeypatch)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("option, text, value", ACCEPTED)
def test_every_entry_point_takes_every_option_alike(entry, option, text, value, record_enable, clean_env,
                                                    tmp_path, request):
    got = _through(entry, option, text, record_enable, clean_env, tmp_path, request)
    assert got == _expected(option, value)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("option, text", REFUSED)
def test_every_entry_point_refuses_alike_and_names_the_flag_or_variable(entry, option, text, record_enable,
                                                                        clean_env, tmp_path, request, capsys):
    import click

    with pytest.raises((ValueError, TypeError, SystemExit, pytest.UsageError, click.UsageError)) as info:
        _through(entry, option, text, record_enable, clean_env, tmp_path, request)
    assert record_enable == []  # nothing enabled
    err = info.value
    message = capsys.readouterr().err if isinstance(err, SystemExit) else (
        err.format_message() if isinstance(err, click.UsageError) else str(err))
    if isinstance(err, SystemExit):
        assert err.code == 2
    kind, _, source = entry.partition(" ")
    if source == "env":
        name = option.env
    elif kind == "run":
        name = option.flag()
    elif kind in ("pytest", "dask"):
        name = "--ump" if kind == "pytest" and option is BACKEND else option.flag("--ump-")
    else:
        name = option.name
    assert name in message, message
    assert "Traceback" not in message


def test_every_field_of_options_is_in_the_table_with_cases():
    assert list(TABLE) == ["backend", *(f.name for f in dataclasses.fields(Options))]
    for option in TABLE.values():
        assert option.examples and option.refused, f"{option.name}: give it accepted and refused texts"
        assert Options() == Options(**{}) and option.help


def test_the_backend_choices_are_the_backends():
    from ump import backends

    assert BACKEND.choices == ("auto", *backends.names())
    assert all(backends.get(name).name == name for name in backends.names())


def test_enable_takes_text_as_the_command_line_does(clean_env, caps):
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")
    with ump.enabled("host", cap="64MiB", prefetch_min="4MiB"):
        assert _enable.current().options == Options(cap=64 << 20, prefetch_min=4 << 20)
        assert ump.statistics()["numpy"].cap_bytes == 64 << 20


def test_an_options_instance_equals_its_text():
    assert Options(cap="4GiB", device="1", placement="host") == Options(cap=4 << 30, device=1, placement="host")
    with pytest.raises(ValueError, match="cap must be a number of bytes from 2097152"):
        Options(cap="1MiB")
    with pytest.raises(ValueError, match="^cap: 'lots' is not a size"):
        Options(cap="lots")


def test_the_environment_is_read_with_flags_winning():
    env = {"UMP_BACKEND": "pinned", "UMP_CAP": "1GiB", "UMP_DEVICE": "1", "UMP_SYNC": "stream", "OTHER": "x"}
    assert _options.resolve({"cap": 2 << 30, "placement": None}, environ=env) == (
        "pinned", {"cap": 2 << 30, "device": 1, "sync": "stream"})
    assert _options.resolve(None, environ={}) == ("auto", {})
    with pytest.raises(ValueError, match="^UMP_CAP: 'lots' is not a size"):
        _options.resolve({}, environ={"UMP_CAP": "lots"})


# --- sizes: one parser, Dask's units ---

@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("4G", 4 * 10**9), ("4GB", 4 * 10**9), ("4GiB", 4 << 30), ("4gi", 4 << 30),
    ("512MiB", 512 << 20), ("2k", 2000), ("2KiB", 2048), ("1tb", 10**12), ("1.5GiB", 3 << 29), ("5.4 kB", 5400),
    ("1e6 kB", 10**9), ("MB", 10**6), ("0.5", 0.5), (".25", 0.25), ("1", 1), ("1.0", 1.0), ("8e9", 8 * 10**9),
    ("4PiB", 4 << 50), ("18446744073709551617", 2**64 + 1),
])
def test_parse_size(text, value):
    got = parse_size(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["4G", "4GB", "4GiB", "512MiB", "2k", "2KiB", "1tb", "1.5GiB", "5.4 kB", "1e6 kB",
                                  "MB", "4096", "8e9", "7 pb", "3 Ti"])
def test_parse_size_reads_units_as_dask_does(text):
    dask_utils = pytest.importorskip("dask.utils", reason="compares with Dask's parse_bytes (pip install dask)")
    assert parse_size(text) == dask_utils.parse_bytes(text)


@pytest.mark.parametrize("text", ["half", "1.5", "-2", "0.0", "4X", "inf", "-inf", "nan", "1e400", "", "e5", ".",
                                  "4 foos"])
def test_parse_size_refuses_what_is_neither(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)
