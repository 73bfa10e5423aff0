"""``python -m ump info``: run as a user runs it, in a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

GPU_BACKENDS = ("system", "managed", "pinned", "device")


def _info(tmp_path, env_value=None, hide_cuda_bindings=False):
    env = {k: v for k, v in os.environ.items() if k != "CUPY_ENABLE_UMP"}
    if env_value is not None:
        env["CUPY_ENABLE_UMP"] = env_value
    if hide_cuda_bindings:
        # None in sys.modules makes `import cuda` fail as it does where the package is absent
        code = "import runpy, sys; sys.modules['cuda'] = None; runpy.run_module('ump', run_name='__main__')"
        cmd = [sys.executable, "-c", code, "info"]
    else:
        cmd = [sys.executable, "-m", "ump", "info"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_info_without_cuda_bindings_says_why_once_and_how_to_install(tmp_path):
    out = _info(tmp_path, hide_cuda_bindings=True)
    lines = out.splitlines()
    assert out.count("cuda-bindings is not installed") == 1
    assert ("GPU: none (cuda-bindings is not installed: pip install ump-unified-memory[cuda12] or "
            "ump-unified-memory[cuda13]") in out
    for name in GPU_BACKENDS:
        assert f"backend {name}: unavailable: no GPU" in lines
    assert "backend host: available" in lines
    assert "enable() would choose: host" in lines


def test_info_without_gpu_says_why_once(tmp_path, caps):
    if caps.gpu:
        pytest.skip("this machine has a GPU")
    out = _info(tmp_path)
    assert out.count(caps.reason) == 1
    assert f"GPU: none ({caps.reason})" in out.splitlines()


def test_info_names_versions_and_missing_packages(tmp_path, caps):
    lines = _info(tmp_path).splitlines()
    assert f"python {caps.python_version}" in lines
    for name, version in (("numpy", caps.numpy_version), ("numpy_allocator", caps.numpy_allocator_version),
                          ("cuda-bindings", caps.cuda_bindings_version)):
        assert f"{name}: {version or 'not installed'}" in lines
    cupy = [line for line in lines if line.startswith("cupy:")]
    if caps.cupy_version is None:
        assert cupy[0].startswith("cupy: not installed")
    else:
        assert cupy == [f"cupy: {caps.cupy_version}"]
    assert not any("None" in line for line in lines[:6])  # ump, python and the four packages


@pytest.mark.parametrize("value, state", [(None, "unset"), ("1", "set to '1'"), ("0", "set to '0'")])
def test_info_shows_cupy_enable_ump(tmp_path, caps, value, state):
    (line,) = [x for x in _info(tmp_path, env_value=value).splitlines() if x.startswith("CUPY_ENABLE_UMP:")]
    assert line.startswith(f"CUPY_ENABLE_UMP: {state} (")
    if value == "1":
        assert "need it set to 1" not in line
    else:
        assert "the GPU backends need it set to 1" in line


def _ump(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "ump", *args], capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: {info,run,bench}"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["info", "--jsn"], "unrecognized arguments: --jsn"),
    (["bench", "--rounds"], "argument --rounds: expected one argument"),
])
def test_bad_usage_prints_the_usage_and_one_line(tmp_path, args, message):
    run = _ump(tmp_path, *args)
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr
    assert run.stderr.startswith("usage: python -m ump") and message in run.stderr.splitlines()[-1], run.stderr


def test_version(tmp_path):
    import ump

    run = _ump(tmp_path, "--version")
    assert run.returncode == 0 and run.stdout == f"ump {ump.__version__}\n"


def test_info_json_is_the_probe_and_the_choice(tmp_path, caps):
    import json

    run = _ump(tmp_path, "info", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["gpu"] == caps.gpu and report["reason"] == caps.reason
    assert report["numpy_version"] == caps.numpy_version and len(report["devices"]) == len(caps.devices)
    assert set(report["backends"]) == set(GPU_BACKENDS) | {"host"}
    if not caps.gpu:
        assert report["choice"] == "host" and report["backends"]["host"] == {"available": True, "reason": None}
        assert report["backends"]["managed"] == {"available": False, "reason": "no GPU"}
    text = _info(tmp_path)
    assert f"enable() would choose: {report['choice']}" in text


@pytest.mark.parametrize("args", [("info",), ("info", "--json"), ("bench", "--input", "REPORT")])
def test_output_to_a_closed_pipe_stops_quietly(tmp_path, args):
    """``python -m ump info | head -1``: a reader that went away ends the
    command with status 1 and no traceback."""
    report = tmp_path / "report.json"
    report.write_text('{"configs": ["stock"], "results": {"np.empty 64B": {"suite": "alloc_numpy", '
                      '"stock": {"cpu": {"median": 1.0, "q1": 1.0, "q3": 1.0, "n": 1}, "gpu": null}}}}')
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails
    try:
        run = subprocess.run([sys.executable, "-m", "ump", *(str(report) if a == "REPORT" else a for a in args)],
                             stdout=write, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    finally:
        os.close(write)
    assert run.returncode == 1 and "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr


def test_a_stopped_bench_run_names_its_partial_report_without_a_traceback(tmp_path):
    """``timeout -s INT N python -m ump bench ...`` (or Ctrl-C) cuts a long
    run short for ``--resume``: the command ends with status 130, says where
    what had finished is, and prints no traceback."""
    out, partial = tmp_path / "b.json", tmp_path / "b.partial.json"
    bench = subprocess.Popen([sys.executable, "-m", "ump", "bench", "--smoke", "--suites", "alloc_numpy",
                              "--configs", "stock", "--rounds", "1000", "--output", str(out), "--plot", ""],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not partial.exists() and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert partial.exists(), "no round finished within a minute"
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    assert bench.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"what had finished is in {partial}" in err and err.rstrip().endswith("bench: stopped")
    assert json.loads(partial.read_text())["partial"] is True and not out.exists()
