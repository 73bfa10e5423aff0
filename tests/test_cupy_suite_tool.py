"""tools/cupy_suite.py on the CPU: a stand-in for CuPy's tests folder (its
pyproject.toml beside it, a tests/cupy_tests/ tree) run stock and under
ump's plugin (the host backend here), one side after the other or both at
once; the counts per directory and the tests whose outcome differs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TOOL = pathlib.Path(__file__).resolve().parent.parent / "tools" / "cupy_suite.py"

TESTS = '''
import os
import time


def test_everywhere():
    assert True


def test_only_stock():
    assert os.environ.get("CUPY_ENABLE_UMP") != "1"  # fails on the ump side


def test_sees_its_gpu():
    assert os.environ.get("CUDA_VISIBLE_DEVICES", "0") in ("0", "1")


def test_slow():
    time.sleep(float(os.environ.get("SLOW", "0")))
'''


@pytest.fixture
def suite(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    folder = tmp_path / "tests" / "cupy_tests" / "core_tests"
    folder.mkdir(parents=True)
    (folder / "test_sample.py").write_text(TESTS)
    out = tmp_path / "out"
    out.mkdir()
    return tmp_path / "tests", out


def _run(suite, **env):
    tests, out = suite
    # The sides see the GPUs the tool gives them, not the ones this run was given.
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("UMP_", "PYTEST_")) and k != "CUDA_VISIBLE_DEVICES"}
    environ.update(env)
    return subprocess.run([sys.executable, str(TOOL), str(tests), str(out), "-p", "no:randomly", "cupy_tests"],
                          env=environ, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("gpus", [None, "0,1"], ids=["one-after-the-other", "both-at-once"])
def test_both_sides_run_and_their_differences_are_listed(suite, gpus):
    result = _run(suite, **({"UMP_SUITE_GPUS": gpus} if gpus else {}))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stock: 4 / 0 / 0" in result.stdout and "ump: 3 / 1 / 0" in result.stdout
    assert "core_tests: 4 / 0 / 0 | 3 / 1 / 0" in result.stdout
    assert "1 tests differ" in result.stdout
    assert "passed -> failed" in result.stdout and "test_only_stock" in result.stdout
    _, out = suite
    assert (out / "cupy-suite-stock.xml").exists() and (out / "cupy-suite-ump.xml").exists()


def test_a_side_past_its_time_is_interrupted_and_keeps_what_ran(suite):
    result = _run(suite, SLOW="60", UMP_SUITE_TIMEOUT="8", UMP_SUITE_RUNS="stock")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stock: interrupted after 8 s" in result.stdout
    assert "stock: 3 / 0 / 0" in result.stdout  # the test cut short is not counted


def test_compare_reads_stored_results(suite):
    assert _run(suite).returncode == 0
    _, out = suite
    result = subprocess.run([sys.executable, str(TOOL), "--compare", str(out / "cupy-suite-stock.xml"),
                             str(out / "cupy-suite-ump.xml")], capture_output=True, text=True, timeout=60)
    assert "1 tests differ" in result.stdout and "test_only_stock" in result.stdout


def test_unreached_lists_the_modules_a_side_has_no_results_for(suite):
    assert _run(suite, UMP_SUITE_RUNS="stock").returncode == 0
    tests, out = suite
    stored = out / "stored"
    stored.mkdir()
    (out / "cupy-suite-stock.xml").rename(stored / "stock-core.xml")
    (tests / "cupy_tests" / "core_tests" / "test_later.py").write_text("def test_a():\n    pass\n\n\n"
                                                                       "def test_b():\n    pass\n")
    (tests / "cupy_tests" / "core_tests" / "test_broken.py").write_text("import not_a_module\n")
    result = subprocess.run([sys.executable, str(TOOL), "--unreached", str(tests), str(stored)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "stock: cupy_tests/core_tests/test_later.py 0 of 2" in lines
    assert "ump: cupy_tests/core_tests/test_sample.py 0 of 4" in lines  # no ump results stored
    assert not any(line.startswith("stock: cupy_tests/core_tests/test_sample.py") for line in lines)
    assert "failed to collect (some modules collect only on a GPU): cupy_tests/core_tests/test_broken.py" in lines
    assert lines[-1] == ("cupy_tests/core_tests/test_broken.py cupy_tests/core_tests/test_later.py "
                         "cupy_tests/core_tests/test_sample.py")


def test_an_empty_budget_leaves_it_to_the_plugin(suite):
    tests, _ = suite
    record = tests.parent / "argv.txt"
    (tests / "cupy_tests" / "core_tests" / "test_argv.py").write_text(
        f"import sys\n\n\ndef test_record_argv():\n    open({str(record)!r}, 'a').write(repr(sys.argv) + '\\n')\n")
    assert _run(suite, UMP_SUITE_RUNS="ump").returncode == 0
    assert "--ump-cap=4G" in record.read_text()
    record.unlink()
    assert _run(suite, UMP_SUITE_RUNS="ump", UMP_CUPY_SUITE_CAP="").returncode == 0
    assert "--ump=auto" in record.read_text() and "--ump-cap" not in record.read_text()


def _junit(path, outcomes):
    cases = "".join(f'<testcase classname="tests.cupy_tests.core_tests.test_x" name="{name}">'
                    + ("<failure message='no'/>" if outcome == "failed" else "") + "</testcase>"
                    for name, outcome in outcomes.items())
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')


def test_stored_merges_each_side_in_the_order_of_runs_txt(tmp_path):
    _junit(tmp_path / "stock-first.xml", {"test_a": "passed", "test_b": "passed"})
    _junit(tmp_path / "ump-first.xml", {"test_a": "failed", "test_b": "passed"})
    _junit(tmp_path / "ump-rerun.xml", {"test_a": "passed"})  # a later run of the ump side

    def stored():
        return subprocess.run([sys.executable, str(TOOL), "--stored", str(tmp_path)],
                              capture_output=True, text=True, timeout=60)

    (tmp_path / "runs.txt").write_text("# oldest first\nfirst\nrerun  # after the fix\n")
    result = stored()
    assert "0 tests differ" in result.stdout and "core_tests: 2 / 0 / 0 | 2 / 0 / 0" in result.stdout
    (tmp_path / "runs.txt").write_text("rerun\nfirst\n")
    result = stored()
    assert "1 tests differ" in result.stdout and "passed -> failed: " in result.stdout
    (tmp_path / "runs.txt").write_text("first\n")
    result = stored()
    assert result.returncode != 0 and "does not list the run(s) rerun" in result.stderr


def test_help_prints_the_usage():
    result = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--stored STORED_DIR" in result.stdout
