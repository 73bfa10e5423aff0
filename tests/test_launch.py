"""Starting ump from outside a program: ``python -m ump run`` and the pytest
plugin, with the host backend (the GPU side runs in test_gpu_startup.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cpu_only(caps):
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")


def _run(args, cwd, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("UMP_")}
    environ.update(env or {})
    environ = {k: v for k, v in environ.items() if v is not None}  # None: unset
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=environ,
                          timeout=120)


PROG = """
    import sys, numpy as np, ump
    print(ump.backend(), ump.kind_of(np.ones(4096)), __name__, sys.argv[1:])
"""


def test_run_script_with_arguments(cpu_only, tmp_path):
    (tmp_path / "prog.py").write_text(textwrap.dedent(PROG))
    run = _run(["-m", "ump", "run", "--cap", "64M", "prog.py", "a", "--flag"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "host host __main__ ['a', '--flag']"


def test_run_module_with_options_from_the_environment(cpu_only, tmp_path):
    (tmp_path / "progmod.py").write_text(textwrap.dedent(PROG))
    run = _run(["-m", "ump", "run", "-m", "progmod", "x"], tmp_path, env={"UMP_BACKEND": "host", "UMP_CAP": "32MiB"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "host host __main__ ['x']"


def test_run_passes_options_after_the_program_to_it(cpu_only, tmp_path):
    """Options after -m MODULE or the script are the program's (-m pytest -x)."""
    (tmp_path / "progmod.py").write_text(textwrap.dedent(PROG))
    (tmp_path / "prog.py").write_text(textwrap.dedent(PROG))
    run = _run(["-m", "ump", "run", "--cap=32M", "-m", "progmod", "-x", "--cap", "9"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "host host __main__ ['-x', '--cap', '9']"
    run = _run(["-m", "ump", "run", "--cap", "32M", "prog.py", "-m", "other"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "host host __main__ ['-m', 'other']"


def test_run_leaves_the_programs_imports_to_it(cpu_only, tmp_path):
    """ump's start-up leaves ``logging`` to the program: NumPy and CuPy do
    not import it, ump needs it only for a placement move it logs, and every
    program started by ``python -m ump run`` would pay for it."""
    (tmp_path / "prog.py").write_text("import sys\nprint('logging' in sys.modules)\n")
    run = _run(["-m", "ump", "run", "prog.py"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_run_script_errors_propagate(cpu_only, tmp_path):
    (tmp_path / "bad.py").write_text("raise SystemExit(7)\n")
    assert _run(["-m", "ump", "run", "bad.py"], tmp_path).returncode == 7
    (tmp_path / "boom.py").write_text("raise KeyError('from the script')\n")
    run = _run(["-m", "ump", "run", "boom.py"], tmp_path)
    assert run.returncode == 1 and "KeyError: 'from the script'" in run.stderr


CHILD_ENV = """
    import os, subprocess, sys
    print(os.environ.get("CUPY_ENABLE_UMP"), os.environ.get("UMP_LAUNCHED"))
    child = "import os; print(os.environ.get('CUPY_ENABLE_UMP'), os.environ.get('UMP_LAUNCHED'))"
    print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip())
"""


@pytest.mark.parametrize("value", [None, "1", "0"], ids=["unset", "1", "0"])
def test_run_leaves_cupy_enable_ump_as_it_was(cpu_only, tmp_path, value):
    """The launcher sets no CUPY_ENABLE_UMP: a child process that does not
    enable ump would take CuPy's own UMP path with it (it asserts on GPUs
    without HMM/ATS). A value the user set stays as it was. It marks the
    process tree instead, so that children that enable ump need no variable."""
    (tmp_path / "prog.py").write_text(textwrap.dedent(CHILD_ENV))
    run = _run(["-m", "ump", "run", "--cap", "64M", "prog.py"], tmp_path, env={"CUPY_ENABLE_UMP": value})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(value), "1"] * 2  # the program's environment, its child's


@pytest.mark.parametrize("args, message", [
    ([], "name a script or -m MODULE"),
    (["missing.py"], "missing.py: no such file"),
    (["--cap", "lots", "x.py"], "'lots' is not a size"),
    (["--cap", "1e400", "x.py"], "'1e400' is not a size"),
    (["--cap", "inf", "x.py"], "'inf' is not a size"),
    (["--cap", "1", "x.py"], "smaller cap would send every array to plain memory"),
    (["--backend", "nosuch", "x.py"], "argument --backend: invalid choice: 'nosuch'"),
    (["--device", "one", "x.py"], "argument --device: 'one' is not a device index"),
    (["--cap"], "argument --cap: expected one argument"),
    (["-m"], "name a script or -m MODULE"),
    (["-m", "no_such_module_here"], "-m no_such_module_here: no module named 'no_such_module_here'"),
    (["-m", "json"], "-m json: json is a package and has no __main__ module"),
    (["-m", "json.no_such_part"], "-m json.no_such_part: no module named 'json.no_such_part'"),
])
def test_run_bad_arguments_say_what_is_wrong(cpu_only, tmp_path, args, message):
    (tmp_path / "x.py").write_text("raise SystemExit('the script must not run')\n")
    run = _run(["-m", "ump", "run", *args], tmp_path)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("usage: python -m ump run [options] (script.py | -m module) [args ...]\n")
    assert len(run.stderr.splitlines()) == 2  # the usage and one line


@pytest.mark.parametrize("env, message", [
    ({"UMP_CAP": "inf"}, "UMP_CAP: 'inf' is not a size"),
    ({"UMP_CAP": "1"}, "UMP_CAP must be a number of bytes from 2097152"),
    ({"UMP_DEVICE": "one"}, "UMP_DEVICE: 'one' is not a device index"),
    ({"UMP_PLACEMENT": "gpu"}, "UMP_PLACEMENT must be one of 'auto', 'host', 'migrate', got 'gpu'"),
    ({"UMP_BACKEND": "nosuch"}, "UMP_BACKEND must be one of 'auto', 'system'"),
])
def test_run_bad_variables_are_usage_errors_naming_the_variable(cpu_only, tmp_path, env, message):
    (tmp_path / "x.py").write_text("raise SystemExit('the script must not run')\n")
    run = _run(["-m", "ump", "run", "x.py"], tmp_path, env=env)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_run_takes_abbreviated_options_and_leaves_the_program_its_own(cpu_only, tmp_path):
    """argparse's conventions: ``--back`` is ``--backend``; after the script
    everything, abbreviations and ``-m`` included, is the program's."""
    (tmp_path / "prog.py").write_text(textwrap.dedent(PROG))
    run = _run(["-m", "ump", "run", "--back", "host", "--ca=64MiB", "prog.py", "--back", "-m", "x"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "host host __main__ ['--back', '-m', 'x']"


def test_pytest_plugin_enables_ump_in_every_worker(cpu_only, tmp_path):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        import numpy as np, pytest, ump

        @pytest.mark.parametrize("i", range(4))
        def test_in_ump_memory(i):
            assert ump.backend() == "host" and ump.kind_of(np.ones(100 + i)) == "host"
    """))
    pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    for extra in ([], ["-n", "2"]):
        run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--ump", "--ump-cap=64M", *extra,
                    str(tmp_path)], tmp_path)
        assert run.returncode == 0 and "4 passed" in run.stdout, run.stdout + run.stderr


def test_pytest_plugin_takes_the_environment_and_splits_the_budget(cpu_only, tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        import ump
        from ump import backends

        def test_budget():
            assert ump.backend() == "host"
            # two workers: each 0.9/2 of the host's available memory, not 3/4 of it
            assert ump.statistics()["numpy"].cap_bytes < 0.5 * backends.host_available_bytes()
    """))
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--ump", "-n", "2", str(tmp_path)], tmp_path,
               env={"UMP_BACKEND": "host"})
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_pytest_plugin_bad_options_are_usage_errors(cpu_only, tmp_path):
    (tmp_path / "test_inner.py").write_text("def test_nothing():\n    pass\n")
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--ump=host", "--ump-cap=lots", str(tmp_path)],
               tmp_path)
    assert run.returncode == 4 and "argument --ump-cap: 'lots' is not a size" in run.stderr
    assert "INTERNALERROR" not in run.stdout + run.stderr


def test_pytest_plugin_loads_by_its_module_name(cpu_only, tmp_path):
    """``-p ump.pytest_plugin`` names the plugin the entry point installs
    (pytest registers an entry point's plugin under the entry point's name),
    so it works whether or not ump is installed; ``-p no:ump.pytest_plugin``
    turns it off."""
    (tmp_path / "test_inner.py").write_text("import ump\n\ndef test_on():\n    assert ump.backend() == 'host'\n")
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ump.pytest_plugin", "--ump=host",
                str(tmp_path)], tmp_path)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:ump.pytest_plugin", "--ump=host",
                str(tmp_path)], tmp_path)
    assert run.returncode == 4 and "unrecognized arguments: --ump=host" in run.stderr, run.stdout + run.stderr


ONLY_THESE = """
    import ump

    def test_under_ump():
        assert ump.backend() == "host"
"""


@pytest.mark.parametrize("path", ["suite", "suite/", "suite/test_more.py", "suite/test_more.py::test_under_ump"])
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["", "xdist"])
def test_pytest_plugin_bare_flag_before_a_path(cpu_only, tmp_path, path, workers):
    """``--ump tests/``: the path is pytest's, not a backend; only it runs."""
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    (tmp_path / "test_elsewhere.py").write_text("def test_must_not_run():\n    raise AssertionError\n")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_more.py").write_text(textwrap.dedent(ONLY_THESE))
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, "--ump", path], tmp_path)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("args, message", [
    (["--ump-cap=4G"], "--ump-cap sets an option of ump, which only --ump enables"),
    (["--ump-sync=stream", "--ump-device=0"], "--ump-device, --ump-sync set an option of ump"),
    (["--ump=bogus"], "--ump: unknown backend 'bogus'; choose one of auto, system"),
    (["--ump", "--ump-placement=gpu"], "argument --ump-placement: invalid choice: 'gpu'"),
    (["--ump", "--ump-cap=1"], "argument --ump-cap: cap must be a number of bytes from 2097152"),
])
def test_pytest_plugin_misuse_is_a_usage_error(cpu_only, tmp_path, args, message):
    (tmp_path / "test_inner.py").write_text("def test_must_not_run():\n    raise AssertionError\n")
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)], tmp_path)
    assert run.returncode == 4 and message in run.stderr, run.stdout + run.stderr
    assert "INTERNALERROR" not in run.stdout + run.stderr and "Traceback" not in run.stderr


def _plugin_installed() -> bool:
    from importlib import metadata

    return any(ep.value == "ump.pytest_plugin" for ep in metadata.entry_points(group="pytest11"))


def test_pytest_plugin_imports_nothing_of_ump_without_the_flag(tmp_path):
    """Every pytest session of the environment loads the plugin: without
    ``--ump`` it leaves ump's C core and its hooks unimported."""
    if not _plugin_installed():
        pytest.skip("ump is not installed here (a source tree on the path): no pytest11 entry point "
                    "loads its plugin")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        import sys

        def test_nothing_of_ump_is_loaded():
            assert "ump.pytest_plugin" in sys.modules
            loaded = sorted(m for m in sys.modules if m.startswith("ump"))
            assert loaded == ["ump", "ump._options", "ump._version", "ump.pytest_plugin"], loaded
    """))
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], tmp_path)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_pytest_plugin_is_off_without_the_flag(cpu_only, tmp_path):
    (tmp_path / "test_inner.py").write_text("import ump\n\ndef test_off():\n    assert ump.backend() is None\n")
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], tmp_path)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
