"""tools/shared_gpu.py and tools/shared_step.py on the CPU: which process
each configuration starts (stock never imports ump; managed-pool is stock
with CuPy's pool over managed memory; a backend goes through ump), and the
table shared_step.py prints from its processes' timings."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


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
    assert not any("device" in arg for arg in auto)
    assert any("device" in arg for arg in device)


def test_the_step_table_gives_medians_and_ratios_to_the_first(monkeypatch, capsys):
    tool = _tool("shared_step")
    per_step = {"stock": [1000.0, 1200.0, 1100.0], "auto": [1500.0, 1650.0, 1800.0]}
    monkeypatch.setattr(tool, "run", lambda config, reads, processes: per_step[config])
    assert tool.main(["--processes", "4", "--reads", "3", "--configs", "stock,auto"]) == 0
    out = capsys.readouterr().out
    assert "round 1, 4 processes, 3 reads, auto: 1500 1650 1800" in out
    assert out.strip().splitlines()[-1] == "4 | 3 | 1100 | 1650 ×1.50"
