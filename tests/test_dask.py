"""ump in Dask workers (ump.dask): the plugin, the preload, the CLI, and a
dask.array pipeline whose chunks cross between worker processes.

Every cluster here but the last test's is a LocalCluster of two worker
processes with one thread each, on the ``host`` backend: these are CPU tests
(they skip on a machine with a GPU, where ``auto`` picks a unified backend).
The last runs the perf suite's Dask workflow small on one GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import ump

distributed = pytest.importorskip(
    "distributed", reason="needs Dask's distributed scheduler: pip install -e '.[dask]'"
)
da = pytest.importorskip("dask.array", reason="needs dask.array: pip install -e '.[dask]'")
import ump.dask as ump_dask  # noqa: E402  (distributed is there)

SEED = 20240601
SHAPE = (1200, 800)
CHUNKS = (300, 800)  # row blocks; the rechunk to column blocks moves every piece
CLUSTER = dict(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0")


@pytest.fixture
def cpu_only(caps):
    if caps.gpu:
        pytest.skip("the host backend runs only on machines without a GPU")


def _chunk(block_info=None):
    # One generator per block, seeded by the block's place: the same numbers
    # whichever worker makes the block, with or without ump.
    info = block_info[None]
    rng = np.random.default_rng([SEED, *info["chunk-location"]])
    return rng.standard_normal(info["chunk-shape"])


def _pipeline():
    x = da.map_blocks(_chunk, chunks=da.core.normalize_chunks(CHUNKS, SHAPE), dtype=np.float64)
    y = x.map_blocks(np.sin).map_blocks(np.cumsum, axis=1)
    y = y.rechunk((SHAPE[0], 200))  # row blocks to column blocks: transfers between workers
    z = y.map_blocks(lambda b: np.cumsum(b * b, axis=0))
    return z, z.sum(axis=0), z.mean()


def _reference():
    """The pipeline's array computed with NumPy alone, in this process."""
    rows = []
    for i in range(SHAPE[0] // CHUNKS[0]):
        rng = np.random.default_rng([SEED, i, 0])
        rows.append(np.cumsum(np.sin(rng.standard_normal(CHUNKS)), axis=1))
    y = np.concatenate(rows)
    return np.cumsum(y * y, axis=0)


def _compute(client):
    z, col, mean = _pipeline()
    z = client.persist(z)
    distributed.wait(z)
    kinds = client.run(_array_kinds)
    moved = client.run(lambda dask_worker: dask_worker.state.transfer_incoming_count_total)
    return client.compute([z, col, mean], sync=True), kinds, moved


def _array_kinds(dask_worker):
    """ump's kind of every NumPy array the worker holds: its own and fetched."""
    return sorted({str(ump.kind_of(v)) for v in dask_worker.data.values() if isinstance(v, np.ndarray)})


def _task_kind():
    return ump.backend(), ump.kind_of(np.ones(1000))


def _task_kinds(client, n=4):
    futures = [client.submit(_task_kind, pure=False) for _ in range(n)]
    distributed.wait(futures, timeout=30)  # a worker that died fails here, not at the suite's timeout
    return set(client.gather(futures))


def test_importing_ump_does_not_import_dask(tmp_path):
    code = "import sys, ump; ump.probe(); sys.exit(any(m.split('.')[0] in ('dask', 'distributed') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0


def test_plugin_enables_every_worker(cpu_only):
    with distributed.LocalCluster(**CLUSTER) as cluster, distributed.Client(cluster) as client:
        assert set(ump_dask.backends(client).values()) == {None}
        # tasks run before the plugin: the worker's threads already exist
        assert _task_kinds(client) == {(None, None)}
        client.register_plugin(ump_dask.UmpPlugin("host", cap=1 << 30))
        got = ump_dask.backends(client)
        assert len(got) == 2 and set(got.values()) == {"host"}
        assert _task_kinds(client) == {("host", "host")}
        client.unregister_worker_plugin(ump_dask.PLUGIN_NAME)
        assert set(ump_dask.backends(client).values()) == {None}
        assert _task_kinds(client) == {(None, None)}


def test_plugin_in_a_process_of_two_workers_outlives_retiring_one(cpu_only):
    """Two workers in this process (processes=False) share one ump: retiring
    one tears its plugin down, and the other's tasks still get ump memory.
    The last teardown disables ump."""
    with distributed.LocalCluster(n_workers=2, processes=False, threads_per_worker=1,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        client.register_plugin(ump_dask.UmpPlugin("host", cap=1 << 30))
        assert ump.backend() == "host"
        assert _task_kinds(client) == {("host", "host")}
        first = sorted(client.scheduler_info()["workers"])[0]
        client.retire_workers([first], close_workers=True)
        deadline = time.monotonic() + 30
        while len(client.scheduler_info()["workers"]) > 1 or len(cluster.scheduler.workers) > 1:
            assert time.monotonic() < deadline, "the retired worker did not leave"
            time.sleep(0.05)
        assert ump.backend() == "host"
        assert _task_kinds(client) == {("host", "host")}
    assert not ump.is_enabled()


def test_plugin_leaves_ump_enabled_where_it_was_before(cpu_only):
    """The plugin disables only what it enabled: ump enabled in this process
    before the workers' plugins stays enabled after their teardown."""
    ump.enable("host", cap=1 << 30)
    with distributed.LocalCluster(n_workers=1, processes=False, threads_per_worker=1,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        client.register_plugin(ump_dask.UmpPlugin("host", cap=1 << 30))
        assert _task_kinds(client, 2) == {("host", "host")}
        client.unregister_worker_plugin(ump_dask.PLUGIN_NAME)
        assert ump.is_enabled()
    assert ump.is_enabled() and ump.kind_of(np.ones(100)) == "host"


def test_plugin_failure_is_reported(cpu_only):
    with pytest.raises(ValueError, match="unknown|backend"):
        ump_dask.UmpPlugin("no-such-backend")
    with pytest.raises(ValueError, match="placement"):
        ump_dask.UmpPlugin("host", placement="nowhere")
    with distributed.LocalCluster(**CLUSTER) as cluster, distributed.Client(cluster) as client:
        with pytest.raises(ump.BackendUnavailableError):
            client.register_plugin(ump_dask.UmpPlugin("managed"))
        assert set(ump_dask.backends(client).values()) == {None}


def test_preload_enables_every_worker(cpu_only):
    with distributed.LocalCluster(**CLUSTER, preload=["ump.dask"],
                                  preload_argv=["--ump-backend", "host", "--ump-cap", "1GiB"]) as cluster, \
            distributed.Client(cluster) as client:
        got = ump_dask.backends(client)
        assert len(got) == 2 and set(got.values()) == {"host"}
        assert _task_kinds(client) == {("host", "host")}


def test_preload_takes_the_backend_from_the_environment(cpu_only, monkeypatch):
    monkeypatch.setenv("UMP_BACKEND", "host")
    monkeypatch.setenv("UMP_CAP", "0.25")
    plugin = ump_dask._plugin(**ump_dask.dask_setup.make_context("dask_setup", []).params)
    assert (plugin.backend, plugin.options) == ("host", {"cap": 0.25})
    ctx = ump_dask.dask_setup.make_context("dask_setup", ["--ump-backend", "auto"])
    assert ump_dask._plugin(**ctx.params).backend == "auto"


def test_dask_worker_command_line(cpu_only, tmp_path):
    """``dask worker SCHEDULER --preload ump.dask --ump-backend host``, as on a cluster."""
    log = tmp_path / "worker.log"
    with distributed.LocalCluster(n_workers=0, dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client, open(log, "w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
             "--nworkers", "1", "--nthreads", "1", "--no-dashboard", "--local-directory", str(tmp_path),
             "--preload", "ump.dask", "--ump-backend", "host", "--ump-cap", "512MiB"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,  # no source tree there shadows the installed ump
            # the tasks are this module's functions, pickled by reference
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                os.path.dirname(__file__), os.environ.get("PYTHONPATH"))))},
        )
        try:
            client.wait_for_workers(1, timeout=30)
            assert list(ump_dask.backends(client).values()) == ["host"], log.read_text()
            assert _task_kinds(client, 2) == {("host", "host")}, log.read_text()
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    assert "Failed to start preload" not in log.read_text()


def test_pipeline_same_with_and_without_ump(cpu_only):
    """Same arrays, bit for bit, with ump in both workers (plugin and preload)
    as without it, and the same mean to rounding (a reduction over both
    workers' blocks, summed in whatever order they arrive); the rechunk moved
    chunks between the workers, and every array a ump worker holds, made
    there or received, is in ump memory."""
    t0 = time.monotonic()
    expected = _reference()
    with distributed.LocalCluster(**CLUSTER) as cluster, distributed.Client(cluster) as client:
        (z0, col0, mean0), kinds0, moved0 = _compute(client)
    assert all(k == ["None"] for k in kinds0.values()) and sum(moved0.values()) > 0
    np.testing.assert_array_equal(z0, expected)

    with distributed.LocalCluster(**CLUSTER) as cluster, distributed.Client(cluster) as client:
        client.register_plugin(ump_dask.UmpPlugin("host", cap=1 << 30))
        (z1, col1, mean1), kinds1, moved1 = _compute(client)
    with distributed.LocalCluster(**CLUSTER, preload=["ump.dask"],
                                  preload_argv=["--ump-backend", "host"]) as cluster, \
            distributed.Client(cluster) as client:
        (z2, col2, mean2), kinds2, moved2 = _compute(client)

    for z, col, mean, kinds, moved in ((z1, col1, mean1, kinds1, moved1), (z2, col2, mean2, kinds2, moved2)):
        np.testing.assert_array_equal(z, z0)
        np.testing.assert_array_equal(col, col0)
        assert mean == pytest.approx(mean0, rel=1e-12)
        assert sum(moved.values()) > 0, "the rechunk moved no chunk between workers"
        assert all(k == ["host"] for k in kinds.values()), kinds
    assert time.monotonic() - t0 < 60


# --- the perf suite's workflow (ump.bench.dask_pipeline), tiny, NumPy in place of CuPy ---

def _workflow():
    return pytest.importorskip("ump.bench.dask_pipeline")


def test_a_cluster_starts_while_port_8787_is_taken():
    """The workflow's scheduler serves its HTTP routes on a port of its own:
    with 8787 taken (another cluster, another user's) starting one must not
    warn, which the test settings turn into a failure."""
    dp = _workflow()
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("", 8787))
        holder.listen(1)
    except OSError:
        pass  # taken already: the case under test
    try:
        with dp.start_cluster("stock", 1, gpu=False, memory_limit="1GiB") as cluster:
            assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    finally:
        holder.close()


def _tiny(dp):
    return dp.Pipeline(size=8 << 20, chunk=1 << 20, frame=256, array_module="numpy")


def test_workflow_same_with_and_without_ump(cpu_only):
    """The workflow of ``python -m ump bench --suites dask`` in two worker
    processes: the same spectrum, bit for bit, with ump's host backend (the
    preload) as without ump, in every repeat; its peaks are the tones; both
    workers computed chunks; ump's workers made their chunks in ump memory."""
    dp = _workflow()
    p = _tiny(dp)
    options = dict(threads=1, memory_limit="2GiB", repeat=2, ump_backend="host", timeout=60)
    without = dp.run_configuration("stock", 2, p, **options)
    with_ump = dp.run_configuration("ump", 2, p, **options)

    assert dp.check([without, with_ump], p) == []
    np.testing.assert_array_equal(with_ump.spectrum.psd, without.spectrum.psd)
    assert without.spectra_agree and with_ump.spectra_agree
    assert with_ump.spectrum.peaks == p.tone_bins == (16, 51, 96)
    np.testing.assert_allclose(without.spectrum.psd, dp.reference(p).psd, rtol=1e-12)
    assert len(without.workers_seen) == len(with_ump.workers_seen) == 2
    assert {(w["backend"], w["numpy_memory"]) for w in without.workers_seen.values()} == {(None, None)}
    assert {(w["backend"], w["numpy_memory"]) for w in with_ump.workers_seen.values()} == {("host", "host")}
    assert all(w["tasks"] > 0 for r in (without, with_ump) for w in r.workers_seen.values())
    assert with_ump.label == "ump (host)" and without.label == "without ump"


def test_workflow_check_catches_a_wrong_result():
    dp = _workflow()
    p = _tiny(dp)
    total = np.ones(p.bins)
    total[list(p.tone_bins)] = 10.0
    good = dp.finish(total, p)
    assert good.peaks == p.tone_bins

    def run(spectrum, config="stock", agree=True):
        return dp.Run(config, False, 2, 1, [1.0], 0.0, 0.0, spectrum, agree,
                      {"cpu0": {"backend": "host" if config == "ump" else None, "numpy_memory": None,
                                "hand_off": None, "tasks": 1, "managed_pool_limit": None}})

    assert dp.check([run(good), run(good, "ump")], p) == []
    off = dp.Spectrum(good.psd * (1 + 1e-15), good.peaks)  # one rounding apart still counts
    (problem,) = dp.check([run(good), run(off, "ump")], p)
    assert "ump (host) on 2 worker(s): spectrum differs from without ump" in problem
    flat = dp.finish(np.ones(p.bins), p)
    assert flat.peaks == ()
    problems = dp.check([run(good), run(flat, "ump", agree=False)], p)
    assert any("repeats gave different spectra" in s for s in problems)
    assert any("peaks at bins []" in s for s in problems)


def test_workflow_command_line_and_bench_cases(cpu_only, tmp_path):
    """``python -m ump.bench.dask_pipeline --cpu``: the table, the verdict and
    the JSON that ``python -m ump bench --suites dask`` turns into cases."""
    out = tmp_path / "dask.json"
    run = subprocess.run(
        [sys.executable, "-m", "ump.bench.dask_pipeline", "--cpu", "--workers", "1,2", "--size", "4MiB",
         "--chunk", "512KiB", "--frame", "256", "--repeat", "1", "--memory-limit", "2GiB", "--json", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "All 4 results identical, bit for bit" in run.stdout
    assert "| 2 | ump (host) |" in run.stdout and "Speed-up 1 → 2 workers:" in run.stdout
    report = json.loads(out.read_text())
    assert report["problems"] == [] and report["nbytes"] == 4 << 20
    assert [(r["workers"], r["config"]) for r in report["runs"]] == [(1, "stock"), (1, "ump"), (2, "stock"),
                                                                      (2, "ump")]
    from ump.bench import cases

    got = cases.dask_cases(report)
    assert set(got) == {"dask 0.00391GiB, 1 worker: without ump", "dask 0.00391GiB, 1 worker: ump (host)",
                        "dask 0.00391GiB, 2 workers: without ump", "dask 0.00391GiB, 2 workers: ump (host)"}
    two = got["dask 0.00391GiB, 2 workers: ump (host)"]["metrics"]
    assert {"GiB/s", "speed-up vs stock", "speed-up vs 1 worker"} == set(two)


def test_workflow_command_line_rejects_what_it_cannot_run(tmp_path):
    def usage(*args):
        run = subprocess.run([sys.executable, "-m", "ump.bench.dask_pipeline", *args], capture_output=True,
                             text=True, cwd=tmp_path, timeout=60)
        assert run.returncode == 2, run.stderr
        return run.stderr

    assert "unknown configuration(s) bogus" in usage("--cpu", "--configs", "stock,bogus")
    assert "--cpu runs only stock, ump" in usage("--cpu", "--configs", "rmm-managed")
    assert "worker counts must be at least 1" in usage("--cpu", "--workers", "0")
    assert "a size in bytes, not a fraction" in usage("--cpu", "--size", "0.5")


@pytest.mark.gpu
def test_workflow_on_the_gpu(gpu_caps):
    """The workflow small on one GPU: the same spectrum, bit for bit, with
    stock CuPy and with ump (the preload); stock's hand-off copies, ump's
    keeps the address of a NumPy array made in ump memory."""
    dp = _workflow()
    p = dp.Pipeline(size=256 << 20, chunk=16 << 20, frame=1024)
    options = dict(threads=2, memory_limit="8GiB", repeat=1, ump_cap="2GiB", timeout=120)
    stock = dp.run_configuration("stock", 1, p, **options)
    with_ump = dp.run_configuration("ump", 1, p, **options)
    assert dp.check([stock, with_ump], p) == []
    assert stock.hand_off == "copy" and with_ump.hand_off == "zero-copy"
    assert all(w["backend"] is None and w["numpy_memory"] is None for w in stock.workers_seen.values())
    assert all(w["backend"] is not None and w["numpy_memory"] == w["backend"]
               for w in with_ump.workers_seen.values())
