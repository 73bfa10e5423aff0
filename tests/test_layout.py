"""The tree's shape, kept: no source file over 1,000 lines, no function over
80, no import cycle among ump's modules, no call cycle among the C core's
units, and only the core's bottom layer (driver.c, device.c, provider.c,
phys.c) calling the driver or mapping memory (tools/check_layout.py)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def layout():
    path = ROOT / "tools" / "check_layout.py"
    if not path.exists():
        pytest.skip("tools/check_layout.py is not in this tree")
    spec = importlib.util.spec_from_file_location("check_layout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_file_or_function_is_too_long(layout):
    assert list(layout.long_files(ROOT)) == []
    assert list(layout.long_functions(ROOT)) == []


def test_no_cycle_among_modules_or_units(layout):
    assert list(layout.cycles(ROOT)) == []


def test_only_the_bottom_layer_calls_the_driver_or_maps_memory(layout):
    assert list(layout.bottom_layer(ROOT)) == []


def test_the_checker_sees_what_it_must_refuse(layout, tmp_path):
    """The checks find a long function, a cycle and a driver call out of
    place when there is one (else an empty answer would mean nothing)."""
    (tmp_path / "csrc").mkdir()
    (tmp_path / "ump").mkdir()
    (tmp_path / "csrc" / "a.c").write_text(
        "int a_call(void)\n{\n    return b_call() + ump__cu.init(0);\n}\n")
    (tmp_path / "csrc" / "b.c").write_text("int b_call(void)\n{\n" + "    x++;\n" * 81 + "    return a_call();\n}\n")
    (tmp_path / "ump" / "__init__.py").write_text("")
    (tmp_path / "ump" / "x.py").write_text("from . import y\n")
    (tmp_path / "ump" / "y.py").write_text("def f():\n    from . import x\n")
    assert [f.split(":")[0] for f in layout.long_functions(tmp_path)] == ["csrc/b.c"]
    assert sorted(layout.cycles(tmp_path)) == ["a cycle among C units: a.c <-> b.c",
                                                "a cycle among Python modules: ump.x <-> ump.y"]
    assert list(layout.bottom_layer(tmp_path)) == ["csrc/a.c calls ump__cu (only device.c, driver.c, "
                                                   "phys.c, provider.c may)"]
