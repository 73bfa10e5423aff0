"""tools/shared_gpu.py and tools/shared_step.py on the CPU: which process
each configuration starts (stock never imports ump; managed-pool is stock
with CuPy's pool over managed memory; a backend goes through ump), how
shared_step.py starts its processes together and gathers their timings, and
the table it prints."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(autouse=True)
def _tools_importable(monkeypatch):
    """As when a tool runs as a script: its folder first on the path."""
    monkeypatch.syspath_prepend(str(TOOLS))


def _tool(name):
    path = TOOLS / f"{name}.py"
    if not path.exists():
        pytest.skip(f"tools/{name}.py is not in this tree")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["shared_gpu", "shared_step"])
def commands(request, monkeypatch):
    """config -> (command line, environment) of one process of the tool."""
    monkeypatch.setenv("CUPY_ENABLE_UMP", "1")
    tool = _tool(request.param)
    if request.param == "shared_gpu":
        return lambda config: tool.command(config, 4, ["pytests"], "out.xml")
    return lambda config: tool.command(config, 3)


def _through_ump(cmd) -> bool:
    return ("-m", "ump") in zip(cmd, cmd[1:]) or "ump.pytest_plugin" in cmd


def test_stock_and_managed_pool_never_reach_ump(commands):
    for config in ("stock", "managed-pool"):
        cmd, env = commands(config)
        assert "CUPY_ENABLE_UMP" not in env
        assert not _through_ump(cmd), cmd
        assert (env.get("UMP_TOOL_MANAGED_POOL") == "1") == (config == "managed-pool")


def test_a_backend_runs_through_ump_and_auto_names_none(commands):
    auto, env = commands("auto")
    device, _ = commands("device")
    assert _through_ump(auto) and _through_ump(device)
    assert "UMP_TOOL_MANAGED_POOL" not in env
    pairs = lambda cmd: list(zip(cmd, cmd[1:]))  # noqa: E731
    assert ("--backend", "device") in pairs(device) or "--ump=device" in device
    assert not any(a == "--backend" or a.startswith("--ump=") for a in auto)


def test_no_ump_setting_of_the_caller_reaches_a_configuration(commands, monkeypatch):
    monkeypatch.setenv("UMP_BACKEND", "device")  # would turn auto into device
    monkeypatch.setenv("UMP_TOOL_MANAGED_POOL", "1")  # would turn stock into managed-pool
    for config in ("stock", "auto"):
        _, env = commands(config)
        assert "UMP_BACKEND" not in env and "UMP_TOOL_MANAGED_POOL" not in env


@pytest.mark.parametrize("name", ["shared_gpu", "shared_step"])
def test_a_stock_worker_imports_nothing_of_ump(name):
    """The step's stock workers run the file itself, and managed-pool
    pytest runs load shared_gpu as a plugin: neither may import ump at its
    top level."""
    tree = ast.parse((TOOLS / f"{name}.py").read_text())
    modules = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert modules and not any(m == "ump" or m.startswith("ump.") for m in modules), modules


WORKER = """
import json, sys, time
print("ready", flush=True)
sys.stdin.readline()  # until every process is ready
print(json.dumps([time.time(), 2.0, 3.0]))
"""


def test_the_step_processes_time_together_and_their_trials_are_pooled(monkeypatch):
    tool = _tool("shared_step")
    monkeypatch.setattr(tool, "command", lambda config, reads: ([sys.executable, "-c", WORKER], {}))
    times = tool.run("stock", 3, 3)
    assert len(times) == 9 and times[1::3] == [2.0] * 3 and times[2::3] == [3.0] * 3
    starts = times[0::3]
    assert max(starts) - min(starts) < 1.0  # each began only once all three were ready


@pytest.mark.parametrize("worker, why", [
    ("import sys; sys.exit('no GPU here')", "no GPU here"),
    ("print('ready', flush=True); input(); print('not json')", "no timings"),
])
def test_a_step_process_that_fails_is_named(monkeypatch, worker, why):
    tool = _tool("shared_step")
    monkeypatch.setattr(tool, "command", lambda config, reads: ([sys.executable, "-c", worker], {}))
    with pytest.raises(SystemExit) as stop:
        tool.run("auto", 2, 2)
    assert "auto (2 reads)" in str(stop.value) and why in str(stop.value)


def test_reads_other_than_two_or_three_are_refused(capsys):
    tool = _tool("shared_step")
    with pytest.raises(SystemExit):
        tool.main(["--reads", "4"])
    assert "2 or 3" in capsys.readouterr().err


def test_the_step_table_gives_medians_and_ratios_to_the_first(monkeypatch, capsys):
    tool = _tool("shared_step")
    per_step = {"stock": [1000.0, 1100.0, 1900.0], "auto": [1500.0, 1650.0, 3000.0]}
    monkeypatch.setattr(tool, "run", lambda config, reads, processes: per_step[config])
    assert tool.main(["--processes", "4", "--reads", "3", "--configs", "stock,auto", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "round 2, 4 processes, 3 reads, stock: 1000 1100 1900" in out
    assert out.index("round 2, 4 processes, 3 reads, auto") < out.index("round 2, 4 processes, 3 reads, stock")
    assert out.strip().splitlines()[-1] == "4 | 3 | 1100 | 1650 ×1.50"  # medians, not means
