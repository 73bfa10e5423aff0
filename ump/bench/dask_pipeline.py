"""A Dask workflow over a large array, with stock CuPy, with CuPy on managed
memory, and with ump, on one GPU and on several.

    python -m ump.bench.dask_pipeline                # 16 GiB; 1 and 2 GPUs; stock, RMM managed, ump
    python -m ump.bench.dask_pipeline --workers 1 --size 32GiB
    python -m ump bench --suites dask                # the same, as a suite of the perf suite

The array holds ``size`` bytes of float32 frames of ``frame`` samples, in
chunks of ``chunk`` bytes. For each chunk, in one task (Dask fuses the
steps, so no intermediate chunk is stored or sent):

1. NumPy makes the frames: noise from a generator seeded by the chunk's
   place, plus fixed tones;
2. NumPy preprocesses them: each frame's mean removed, a Hann window applied;
3. ``map_blocks(cupy.asarray)`` hands the chunk to the GPU;
4. CuPy transforms it: ``cupy.fft.rfft`` of every frame, the power of each
   frequency, summed over the chunk's frames in float64;
5. ``map_blocks(cupy.asnumpy)`` hands that sum (one row) back to NumPy.

``dask.array.sum`` then adds the chunks' rows across workers, in NumPy, and
the client finishes in NumPy: the averaged power spectrum and its peaks,
which must be the tones.

Every configuration gets a cluster of its own, with one worker process per
GPU, pinned to it with ``CUDA_VISIBLE_DEVICES`` (as dask-cuda's
``LocalCUDACluster`` does; dask-cuda itself is not needed):

- ``stock``: CuPy as installed (``CUPY_ENABLE_UMP=0`` in the workers);
- ``rmm-managed``: CuPy allocating from an RMM pool of managed memory
  (``rmm.reinitialize(pool_allocator=True, managed_memory=True)`` and RMM's
  CuPy allocator: what dask-cuda's ``rmm_pool_size``,
  ``rmm_managed_memory=True`` and ``rmm_allocator_external_lib_list="cupy"``
  set up);
- ``cupy-managed``: CuPy's own ``MemoryPool(cupy.cuda.malloc_managed)``,
  the same without RMM;
- ``ump``: ump enabled in every worker by the ``ump.dask`` preload.

The managed pools grow up to the device's free memory less ump's headroom,
read in each worker as it starts: never more managed memory than the GPU
holds.

With ``--cpu`` NumPy stands in for CuPy and the workers use no GPU (the
tests run the pipeline this way, with ump's ``host`` backend).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import logging
import os
import statistics
import sys
import time

import numpy as np

from .. import dask as ump_dask  # first: without distributed, its ImportError says what to install
from .._options import parse_size
from ..backends import default_headroom
from distributed import Client, Nanny, Scheduler, SpecCluster, WorkerPlugin

__all__ = ["CONFIGS", "DEFAULT_CONFIGS", "ManagedPool", "Pipeline", "Run", "Spectrum", "check",
           "compare", "finish", "reference", "run_configuration", "spectrum_graph", "start_cluster", "table"]

GiB = 1 << 30
MiB = 1 << 20

#: Configuration name -> what it is, as the report names it.
CONFIGS = {
    "stock": "stock CuPy",
    "rmm-managed": "RMM managed pool",
    "cupy-managed": "CuPy managed pool",
    "ump": "ump",
}
DEFAULT_CONFIGS = ("stock", "rmm-managed", "ump")
#: The configurations a run without a GPU can make: no managed memory there.
CPU_CONFIGS = ("stock", "ump")

#: The tones every frame carries: (bin as a fraction of the frame, amplitude).
#: A tone's peak over the noise grows with the frame: at 256 samples the
#: weakest is 3.7 times the noise, above the twice that finish() asks of a peak.
TONES = ((1 / 16, 1.0), (1 / 5, 0.5), (3 / 8, 0.25))


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The workflow's parameters.

    Parameters
    ----------
    size : int
        Bytes of the float32 array (rounded down to whole frames).
    chunk : int
        Bytes of one chunk (rounded down to whole frames, one at least).
    frame : int
        Samples of one frame: the length of each FFT.
    seed : int
        Seed of every chunk's generator, with the chunk's place.
    array_module : {"cupy", "numpy"}
        The module of the transform; ``"numpy"`` runs it on the CPU.

    Raises
    ------
    ValueError
        A frame under 64 samples, a size under one frame, another module.
    """

    size: int = 16 * GiB
    chunk: int = 128 * MiB
    frame: int = 4096
    seed: int = 20240601
    array_module: str = "cupy"

    def __post_init__(self):
        if self.frame < 64:
            raise ValueError(f"frame must be at least 64 samples, got {self.frame}")
        if self.size < self.frame * 4:
            raise ValueError(f"size must hold one frame ({self.frame * 4} bytes) at least, got {self.size}")
        if self.array_module not in ("cupy", "numpy"):
            raise ValueError(f"array_module must be 'cupy' or 'numpy', got {self.array_module!r}")

    @property
    def rows(self) -> int:
        return self.size // (self.frame * 4)

    @property
    def rows_per_chunk(self) -> int:
        return min(self.rows, max(1, self.chunk // (self.frame * 4)))

    @property
    def nbytes(self) -> int:
        return self.rows * self.frame * 4

    @property
    def chunks(self) -> tuple:
        full, rest = divmod(self.rows, self.rows_per_chunk)
        return (self.rows_per_chunk,) * full + ((rest,) if rest else ()), (self.frame,)

    @property
    def bins(self) -> int:
        return self.frame // 2 + 1

    @property
    def tone_bins(self) -> tuple[int, ...]:
        return tuple(int(self.frame * f) for f, _ in TONES)

    def describe(self) -> str:
        n = len(self.chunks[0])
        return (f"{self.nbytes / GiB:.3g} GiB of float32 ({self.rows} frames of {self.frame} samples) "
                f"in {n} chunk{'s' * (n > 1)} of {self.rows_per_chunk * self.frame * 4 / MiB:.3g} MiB")


# --- the per-chunk steps: module-level functions, so workers import them ---

@functools.lru_cache(maxsize=4)
def _tones(frame: int) -> np.ndarray:
    t = np.arange(frame)
    tone = sum(a * np.sin(2 * np.pi * int(frame * f) * t / frame) for f, a in TONES)
    return tone.astype(np.float32)


@functools.lru_cache(maxsize=4)
def _window(frame: int) -> np.ndarray:
    return np.hanning(frame).astype(np.float32)


def _frames(seed: int, frame: int, block_info=None) -> np.ndarray:
    """One chunk of frames: noise plus the tones. One generator per chunk,
    seeded by its place: the same numbers on any worker, in any configuration."""
    info = block_info[None]
    rng = np.random.default_rng([seed, *info["chunk-location"]])
    x = rng.standard_normal(info["chunk-shape"], dtype=np.float32)
    x += _tones(frame)
    return x


def _preprocess(x: np.ndarray) -> np.ndarray:
    # A new array, not x changed in place: Dask may still hold x.
    y = x - x.mean(axis=1, keepdims=True)
    y *= _window(x.shape[1])
    return y


def _power_sum(g, array_module: str):
    """The power of each frequency, summed over the chunk's frames: one row."""
    xp = importlib.import_module(array_module)
    f = xp.fft.rfft(g, axis=1)
    return (f.real * f.real + f.imag * f.imag).sum(axis=0, keepdims=True, dtype=np.float64)


def _to_numpy(a, array_module: str) -> np.ndarray:
    xp = importlib.import_module(array_module)
    return xp.asnumpy(a) if hasattr(xp, "asnumpy") else a


def spectrum_graph(p: Pipeline):
    """The workflow as a Dask array: the sum over all frames of the power of
    each frequency (one NumPy row of ``p.bins`` float64), not yet computed.

    Notes
    -----
    ``meta=`` tells Dask each step's array type, so it never calls the
    steps on empty arrays to find out; with ``array_module="cupy"`` the
    client imports CuPy for that, and runs nothing on the GPU.
    """
    import dask.array as da

    xp = importlib.import_module(p.array_module)
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    frames = da.map_blocks(_frames, p.seed, p.frame, chunks=p.chunks, dtype=f32, meta=np.empty((0, 0), f32),
                           name="frames")
    frames = frames.map_blocks(_preprocess, dtype=f32, meta=np.empty((0, 0), f32))
    on_gpu = frames.map_blocks(xp.asarray, dtype=f32, meta=xp.empty((0, 0), f32))
    rows = ((1,) * len(p.chunks[0]), (p.bins,))
    power = on_gpu.map_blocks(_power_sum, p.array_module, chunks=rows, dtype=f64, meta=xp.empty((0, 0), f64))
    power = power.map_blocks(_to_numpy, p.array_module, dtype=f64, meta=np.empty((0, 0), f64))
    return power.sum(axis=0)


@dataclasses.dataclass(frozen=True)
class Spectrum:
    """The finished result: the power spectrum averaged over all frames, in
    units of the noise's (1 where there is only noise), and its peaks."""

    psd: np.ndarray
    peaks: tuple[int, ...]

    def same_as(self, other: Spectrum) -> bool:
        return self.peaks == other.peaks and np.array_equal(self.psd, other.psd)

    def difference(self, other: Spectrum) -> float:
        """Largest relative difference of the two spectra."""
        return float(np.max(np.abs(self.psd - other.psd) / np.abs(other.psd)))


def finish(total: np.ndarray, p: Pipeline) -> Spectrum:
    """NumPy's part at the end: average, normalise, find the peaks (local
    maxima at least twice the median, the noise's level)."""
    w = _window(p.frame).astype(np.float64)
    psd = total / (p.rows * np.dot(w, w))
    inner = psd[1:-1]
    local_max = (inner > psd[:-2]) & (inner >= psd[2:]) & (inner > 2 * np.median(psd))
    return Spectrum(psd, tuple(int(k) + 1 for k in np.flatnonzero(local_max)))


def reference(p: Pipeline) -> Spectrum:
    """The same spectrum without Dask: every chunk in turn, in this process."""
    xp = importlib.import_module(p.array_module)
    partial = []
    for i, n in enumerate(p.chunks[0]):
        x = _frames(p.seed, p.frame, block_info={None: {"chunk-location": (i, 0), "chunk-shape": (n, p.frame)}})
        partial.append(_to_numpy(_power_sum(xp.asarray(_preprocess(x)), p.array_module), p.array_module))
    return finish(np.concatenate(partial).sum(axis=0), p)


# --- managed memory for CuPy, as users already have it ----------------------

def _round_down(n: int, to: int = 256) -> int:
    return n // to * to


class ManagedPool(WorkerPlugin):
    """CuPy allocates managed memory from a pool, in every worker.

    Parameters
    ----------
    anchor : {"rmm", "cupy"}
        ``"rmm"``: ``rmm.reinitialize(pool_allocator=True,
        managed_memory=True)`` and RMM's CuPy allocator; ``"cupy"``:
        ``cupy.cuda.MemoryPool(cupy.cuda.malloc_managed)``.

    Notes
    -----
    The pool may grow to the device's free memory at set-up less ump's
    headroom (:func:`ump.backends.default_headroom`), so it never holds more
    managed memory than the GPU can; RMM's pool starts at half the device's
    memory (RMM's default) or that limit if smaller. Register the plugin
    before the workers import CuPy: it sets CuPy's allocator for the whole
    process.
    """

    name = "managed-pool"

    def __init__(self, anchor: str):
        if anchor not in ("rmm", "cupy"):
            raise ValueError(f"anchor must be 'rmm' or 'cupy', got {anchor!r}")
        self.anchor = anchor

    def setup(self, worker):
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        limit = _round_down(free - default_headroom(total))
        if limit <= 0:
            raise RuntimeError(f"no room for a managed pool: {free} bytes free on the device")
        if self.anchor == "rmm":
            import rmm
            from rmm.allocators.cupy import rmm_cupy_allocator

            rmm.reinitialize(pool_allocator=True, managed_memory=True,
                             initial_pool_size=min(_round_down(total // 2), limit), maximum_pool_size=limit)
            cupy.cuda.set_allocator(rmm_cupy_allocator)
        else:
            pool = cupy.cuda.MemoryPool(cupy.cuda.malloc_managed)
            pool.set_limit(size=limit)
            cupy.cuda.set_allocator(pool.malloc)
        worker.managed_pool_limit = limit


def _managed_limit(dask_worker):
    return getattr(dask_worker, "managed_pool_limit", None)


# --- clusters --------------------------------------------------------------

def _visible_devices(n: int) -> list[str]:
    """The devices for ``n`` workers, counted within this process's
    CUDA_VISIBLE_DEVICES when it is set."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return [str(i) for i in range(n)]
    if n > len(visible):
        raise ValueError(f"{n} workers, one per GPU, but CUDA_VISIBLE_DEVICES names {len(visible)}")
    return visible[:n]


def start_cluster(config: str, workers: int, *, gpu: bool = True, threads: int = 1,
                  memory_limit: int | str = "64GiB", ump_backend: str = "auto", ump_cap=None) -> SpecCluster:
    """A local cluster for one configuration: ``workers`` worker processes
    (with a GPU each when ``gpu``), ``threads`` threads each.

    Parameters
    ----------
    config : str
        One of :data:`CONFIGS`. Only ``"ump"`` changes the workers here (the
        preload); the managed pools are :class:`ManagedPool`, registered by
        :func:`run_configuration`.
    memory_limit : int or str
        Per worker. A fixed figure rather than Dask's share of the host's
        memory: the workflow holds a few chunks per thread, and some hosts
        report less memory at start than they give later.

    Notes
    -----
    Each worker gets ``CUDA_VISIBLE_DEVICES`` naming its GPU, so that it sees
    that GPU as device 0 (ump's default device), and ``CUPY_ENABLE_UMP``:
    1 with ump, 0 otherwise, whatever the client's environment says.
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")
    devices = _visible_devices(workers) if gpu else [None] * workers
    options = dict(nthreads=threads, memory_limit=memory_limit, host="127.0.0.1", dashboard=False,
                   silence_logs=logging.WARNING)
    if config == "ump":
        argv = ["--ump-backend", ump_backend] + (["--ump-cap", str(ump_cap)] if ump_cap is not None else [])
        options.update(preload=["ump.dask"], preload_argv=argv)
    spec = {}
    for i, device in enumerate(devices):
        env = {"CUPY_ENABLE_UMP": "1" if config == "ump" else "0"}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        name = f"gpu{device}" if device is not None else f"cpu{i}"
        spec[name] = {"cls": Nanny, "options": {**options, "env": env}}
    # The scheduler serves its HTTP routes even without a dashboard, and with no
    # address on port 8787: a port of its own, so a cluster already there
    # (another user's, a test's) is no warning.
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False, "dashboard_address": ":0"}}
    return SpecCluster(workers=spec, scheduler=scheduler, silence_logs=logging.WARNING, name=f"ump-bench-{config}")


def _hand_off(array_module: str) -> dict:
    """Run as a task: ump's backend in this worker, the kind of memory of a
    NumPy array a task makes, whether handing it to the array module keeps
    its address (zero-copy) or copies it, and how many bytes ump served
    from plain memory because its arena was full (the cap reached)."""
    import ump

    a = np.ones(1 << 20, np.float32)
    g = importlib.import_module(array_module).asarray(a)
    if array_module == "numpy":
        moved = None  # no hand-off: NumPy stands in for the GPU
    else:
        moved = "zero-copy" if g.data.ptr == a.ctypes.data else "copy"
    backend = ump.backend()
    past_cap = ump.statistics()["fallback"].total_bytes if backend is not None else None
    return {"backend": backend, "numpy_memory": ump.kind_of(a), "hand_off": moved, "ump_past_cap_bytes": past_cap}


def _executed(dask_worker) -> int:
    return dask_worker.state.executed_count


@dataclasses.dataclass
class Run:
    """One configuration on ``workers`` workers: wall times of the repeats
    (seconds, graph submitted to result finished), and what it computed."""

    config: str
    gpu: bool
    workers: int
    threads: int
    seconds: list
    startup_s: float
    warmup_s: float
    spectrum: Spectrum
    spectra_agree: bool  # every repeat gave the same spectrum
    workers_seen: dict  # worker name -> _hand_off's dict, with "tasks" (run so far) and "managed_pool_limit"

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def hand_off(self) -> str:
        kinds = {w["hand_off"] for w in self.workers_seen.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed: " + ", ".join(sorted(map(str, kinds)))

    @property
    def label(self) -> str:
        if self.config == "stock" and not self.gpu:
            return "without ump"
        if self.config != "ump":
            return CONFIGS[self.config]
        names = sorted({str(w["backend"]) for w in self.workers_seen.values()})
        return f"ump ({', '.join(names)})"

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spectrum"}
        d.update(median_s=self.median_s, label=self.label, peaks=list(self.spectrum.peaks))
        return d


def run_configuration(config: str, workers: int, p: Pipeline, *, threads: int = 1, memory_limit="64GiB",
                      repeat: int = 3, ump_backend: str = "auto", ump_cap=None, timeout: float = 120,
                      progress=None) -> Run:
    """Start a cluster for ``config``, warm it up (one chunk per worker
    thread: kernels compiled, FFT plans made, pools filled), then time
    ``repeat`` runs of the workflow.

    Raises
    ------
    RuntimeError
        A worker without ump in the ``ump`` configuration (its log says why),
        or a worker that did no work.
    """
    gpu = p.array_module == "cupy"
    say = (lambda text: print(text, file=progress, flush=True)) if progress else (lambda text: None)
    t0 = time.perf_counter()
    with start_cluster(config, workers, gpu=gpu, threads=threads, memory_limit=memory_limit,
                       ump_backend=ump_backend, ump_cap=ump_cap) as cluster, Client(cluster) as client:
        client.wait_for_workers(workers, timeout=timeout)
        if config in ("rmm-managed", "cupy-managed"):
            client.register_plugin(ManagedPool(config.partition("-")[0]))
        if config == "ump":
            missing = [w for w, b in ump_dask.backends(client).items() if b is None]
            if missing:
                raise RuntimeError(f"ump is not enabled in worker(s) {', '.join(missing)}: see their log "
                                   "(\"Failed to start preload\")")
        startup = time.perf_counter() - t0

        t0 = time.perf_counter()
        warm = dataclasses.replace(p, size=min(p.size, p.rows_per_chunk * p.frame * 4 * workers * threads))
        client.compute(spectrum_graph(warm)).result(timeout=timeout)
        warmup = time.perf_counter() - t0
        say(f"  {config} on {workers} worker(s): started in {startup:.1f} s, warmed up in {warmup:.1f} s")

        graph = spectrum_graph(p)
        seconds, spectra = [], []
        for i in range(repeat):
            t0 = time.perf_counter()
            total = client.compute(graph).result(timeout=timeout)
            spectra.append(finish(total, p))
            seconds.append(time.perf_counter() - t0)
            say(f"  {config} on {workers} worker(s), run {i + 1}/{repeat}: {seconds[-1]:.2f} s")

        seen = {}
        info = client.scheduler_info()["workers"]
        tasks = client.run(_executed)
        limits = client.run(_managed_limit)
        for address, w in info.items():
            checked = client.submit(_hand_off, p.array_module, workers=[address], allow_other_workers=False,
                                    pure=False).result(timeout=timeout)
            seen[w["name"]] = {**checked, "tasks": tasks[address], "managed_pool_limit": limits[address]}
    idle = [name for name, w in seen.items() if w["tasks"] == 0]
    if idle:
        raise RuntimeError(f"worker(s) {', '.join(idle)} ran no task")
    return Run(config, gpu, workers, threads, seconds, startup, warmup, spectra[0],
               all(s.same_as(spectra[0]) for s in spectra), seen)


def compare(p: Pipeline, configs=DEFAULT_CONFIGS, worker_counts=(1, 2), progress=None, **options) -> list[Run]:
    """Every configuration on every worker count, one cluster after another.
    ``options`` go to :func:`run_configuration`."""
    runs = []
    for n in worker_counts:
        for config in configs:
            runs.append(run_configuration(config, n, p, progress=progress, **options))
    return runs


def check(runs: list[Run], p: Pipeline) -> list[str]:
    """What is wrong with the results, if anything: every run and repeat must
    give the first run's spectrum, bit for bit, with the tones as its peaks."""
    problems = []
    first = runs[0]
    for r in runs:
        where = f"{r.label} on {r.workers} worker(s)"
        if not r.spectra_agree:
            problems.append(f"{where}: the repeats gave different spectra")
        if r.spectrum.peaks != p.tone_bins:
            problems.append(f"{where}: peaks at bins {list(r.spectrum.peaks)}, the tones are at {list(p.tone_bins)}")
        if r is not first and not r.spectrum.same_as(first.spectrum):
            problems.append(f"{where}: spectrum differs from {first.label} on {first.workers} worker(s) "
                            f"(largest relative difference {r.spectrum.difference(first.spectrum):.3g})")
    return problems


def table(runs: list[Run], p: Pipeline) -> str:
    """Markdown: one row per run, its speed against stock on as many workers,
    then the speed-up from the fewest workers to each larger count."""
    base = {r.workers: r.median_s for r in runs if r.config == "stock"}
    unit = "GPUs" if p.array_module == "cupy" else "workers"
    lines = [f"| {unit} | configuration | wall time (median) | throughput | vs stock | hand-off | NumPy chunks in |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        speed = f"×{base[r.workers] / r.median_s:.2f}" if r.workers in base else ""
        memory = sorted({str(w["numpy_memory"]) if w["numpy_memory"] else "plain memory"
                         for w in r.workers_seen.values()})
        lines.append(f"| {r.workers} | {r.label} | {r.median_s:.2f} s | {p.nbytes / GiB / r.median_s:.2f} GiB/s "
                     f"| {speed} | {r.hand_off or 'none (CPU)'} | {', '.join(memory)} |")
    for r in runs:
        past = {n: w["ump_past_cap_bytes"] for n, w in r.workers_seen.items() if w.get("ump_past_cap_bytes")}
        if past:
            lines.append(f"\n{r.label} on {r.workers} {unit}: ump's arena was full (its cap reached) and "
                         "plain memory served " + ", ".join(f"{n} {b / GiB:.3g} GiB" for n, b in sorted(past.items())))
    counts = sorted({r.workers for r in runs})
    if len(counts) > 1:
        lines.append("")
        for n in counts[1:]:
            parts = []
            for config in dict.fromkeys(r.config for r in runs):
                by = {r.workers: r for r in runs if r.config == config}
                if counts[0] in by and n in by:
                    parts.append(f"{by[n].label} ×{by[counts[0]].median_s / by[n].median_s:.2f}")
            lines.append(f"Speed-up {counts[0]} → {n} {unit}: " + ", ".join(parts))
    return "\n".join(lines)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _gpu_count() -> int:
    from .. import probe

    return len(probe().devices)


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of worker counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"worker counts must be at least 1: {text!r}")
    return counts


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if isinstance(value, float):
        raise argparse.ArgumentTypeError(f"a size in bytes, not a fraction: {text!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ump.bench.dask_pipeline",
        description="A Dask workflow (NumPy chunks, FFT on the GPU, reduction, NumPy finish) with stock CuPy, "
                    "CuPy on managed memory and ump, one worker process per GPU.")
    parser.add_argument("--size", type=_size, default=Pipeline.size, help="bytes of the array (default 16GiB)")
    parser.add_argument("--chunk", type=_size, default=Pipeline.chunk, help="bytes of a chunk (default 128MiB)")
    parser.add_argument("--frame", type=int, default=Pipeline.frame, help="samples per FFT (default 4096)")
    parser.add_argument("--workers", type=_counts, help="worker counts to run, one GPU per worker "
                                                        "(default: 1 and 2, as far as the GPUs go)")
    parser.add_argument("--configs", help=f"comma-separated, of {', '.join(CONFIGS)} "
                                          f"(default {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--threads", type=int, help="threads per worker (default: the cores per GPU)")
    parser.add_argument("--memory-limit", default="64GiB", help="per worker (default 64GiB)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per configuration (default 3)")
    parser.add_argument("--ump-backend", default="auto", help="the ump configuration's backend (default auto)")
    parser.add_argument("--ump-cap", help="the ump configuration's cap per worker (default: ump's)")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a cluster may take to start, or one computation to finish (default 120)")
    parser.add_argument("--cpu", action="store_true",
                        help="no GPU: NumPy stands in for CuPy; configurations stock and ump (backend host)")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)

    configs = tuple(args.configs.split(",")) if args.configs else (CPU_CONFIGS if args.cpu else DEFAULT_CONFIGS)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if args.cpu:
        if set(configs) - set(CPU_CONFIGS):
            parser.error(f"--cpu runs only {', '.join(CPU_CONFIGS)}")
        workers = args.workers or (1, 2)
        threads = args.threads or 1
        backend = "host" if args.ump_backend == "auto" else args.ump_backend
    else:
        gpus = _gpu_count()
        if gpus == 0:
            parser.error("no GPU here: --cpu runs the workflow with NumPy in place of CuPy")
        workers = args.workers or tuple(n for n in (1, 2) if n <= gpus)
        if max(workers) > gpus:
            parser.error(f"{max(workers)} workers need as many GPUs; this machine has {gpus}")
        threads = args.threads or max(1, _cores() // gpus)
        backend = args.ump_backend
    try:
        p = Pipeline(size=args.size, chunk=args.chunk, frame=args.frame,
                     array_module="numpy" if args.cpu else "cupy")
    except ValueError as err:
        parser.error(str(err))

    print(f"Dask workflow: {p.describe()}; {threads} thread(s) per worker; median of {args.repeat}",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    runs = compare(p, configs, workers, progress=sys.stderr, threads=threads, memory_limit=args.memory_limit,
                   repeat=args.repeat, ump_backend=backend, ump_cap=args.ump_cap, timeout=args.timeout)
    problems = check(runs, p)
    print(f"Dask workflow: {p.describe()}; {threads} thread(s) per worker; wall time: median of {args.repeat}")
    print(table(runs, p))
    if problems:
        print("\nRESULTS DIFFER:\n" + "\n".join(problems))
    else:
        print(f"\nAll {len(runs)} results identical, bit for bit; peaks at the tones' bins {list(p.tone_bins)}.")
    print(f"Total {time.perf_counter() - t0:.0f} s.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pipeline": dataclasses.asdict(p), "nbytes": p.nbytes, "problems": problems,
                       "runs": [r.as_dict() for r in runs]}, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
