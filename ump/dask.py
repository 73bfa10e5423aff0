"""ump in every Dask worker: a worker plugin and a preload module.

Two ways in, one mechanism (:class:`UmpPlugin`):

- ``dask worker SCHEDULER --preload ump.dask --ump-backend managed`` (or
  ``LocalCluster(preload=["ump.dask"])``, ``LocalCUDACluster(preload=...)``)
  enables ump while the worker starts, before any task runs or CuPy is
  imported there. This is the way to be first.
- ``client.register_plugin(UmpPlugin("managed", cap=0.5))`` enables ump in
  workers that are already running, and in every worker that joins later.

:func:`backends` reports each worker's backend.

Importing :mod:`ump` never imports Dask; importing this module does.
"""

from __future__ import annotations

import logging
import threading

from ._version import pip_install

try:
    import click
    from distributed import WorkerPlugin
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(f"ump.dask needs Dask's distributed scheduler: {pip_install('dask')}") from err

from . import _enable, _numpy_hook, backends as _backends
from ._options import TABLE, Options, resolve

__all__ = ["UmpPlugin", "backends", "dask_setup"]

logger = logging.getLogger("distributed.worker")

PLUGIN_NAME = "ump"

# ump is enabled once per process, and a process may hold several workers
# (LocalCluster(processes=False)): the plugin is set up in each. Only the
# teardown of the last one disables ump, and only if a plugin enabled it.
_process_lock = threading.Lock()
_process_setups = 0
_process_owns_enable = False


class UmpPlugin(WorkerPlugin):
    """Enable ump in a Dask worker process.

    Parameters
    ----------
    backend : str
        Passed to :func:`ump.enable` (``"auto"`` by default).
    **options
        Options of :func:`ump.enable` (:class:`ump.Options`); checked here,
        in the client, so a typo fails before any worker sees it.

    Raises
    ------
    ValueError, TypeError
        Bad options or an unknown backend name.

    Notes
    -----
    The worker keeps the name of the backend it got in
    ``worker.ump_backend``; :func:`backends` collects them.

    NumPy keeps its allocator in a context variable (NEP 49) and Dask runs
    each task in a copy of the context of the event-loop task that scheduled
    it. Enabling ump in :meth:`setup` changes only the context ``setup`` runs
    in, so the plugin also puts ump's handler into the context that starts
    each task (:meth:`transition`): every task, and every NumPy array it
    makes, then uses ump whenever the plugin was registered.

    ump is enabled for the whole process: where one process holds several
    workers (``LocalCluster(processes=False)``), each sets the plugin up,
    and ump is disabled only at the teardown of the last, and only if it
    was not enabled before the first.

    Registered on a running worker, the plugin comes after whatever that
    worker already imported: :func:`ump.enable` raises there if CuPy was
    imported with ``CUPY_ENABLE_UMP=1`` on a GPU without HMM/ATS. Start the
    workers with the preload (``--preload ump.dask``) to be first.
    """

    name = PLUGIN_NAME

    def __init__(self, backend: str = "auto", **options):
        if backend != "auto":
            _backends.get(backend)  # unknown names fail in the client
        Options(**options)  # so do bad options
        self.backend = backend
        self.options = options
        self._setups = 0  # this instance's live setups (an instance may serve several workers)

    def setup(self, worker):
        """Enable ump in the worker's process; store the backend on the worker.

        Raises
        ------
        ump.UmpError, ump.BackendUnavailableError
            From :func:`ump.enable`; Dask logs them in the worker and returns
            them to ``client.register_plugin``.
        """
        from . import enable, is_enabled

        global _process_setups, _process_owns_enable
        with _process_lock:
            was_enabled = is_enabled()
            name = enable(self.backend, **self.options)
            if _process_setups == 0:
                _process_owns_enable = not was_enabled
            _process_setups += 1
            self._setups += 1
        worker.ump_backend = name
        logger.info("ump enabled in worker %s: backend %r", worker.address, name)
        return name

    def transition(self, key, start, finish, **kwargs):
        # Called by the worker's state machine in the context that goes on to
        # create the task's execution, before it does: enter ump's handler
        # there, once per context, so the copy the task runs in has it.
        if finish == "executing" and self._setups and _enable.current() is not None:
            _numpy_hook.enter()

    def teardown(self, worker):
        """Disable ump again when the plugin is removed or the worker closes:
        at the last teardown in the process, if the plugin enabled ump."""
        from . import disable

        global _process_setups
        with _process_lock:
            if not self._setups:
                return
            if _process_setups == 1 and _process_owns_enable:
                disable()  # first: if it raises, the counts still hold
            self._setups -= 1
            _process_setups -= 1
        worker.ump_backend = None


def _worker_backend(dask_worker) -> str | None:
    return getattr(dask_worker, "ump_backend", None)


def backends(client) -> dict:
    """Each worker's ump backend.

    Parameters
    ----------
    client : distributed.Client

    Returns
    -------
    dict
        ``{worker address: backend name}``; None where ump is not enabled
        (the worker's log says why, when enabling failed).
    """
    return client.run(_worker_backend)


class _OptionType(click.ParamType):
    """An option of the table as a click type: the text parsed and checked."""

    def __init__(self, option):
        self.option = option
        self.name = option.metavar

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.option.check(self.option.name, self.option.parse(value))
        except (ValueError, TypeError) as err:
            self.fail(str(err), param, ctx)


def _with_options(command):
    """``--ump-NAME`` for every option of the table. Values not given come
    from the ``UMP_*`` variables, read as ``python -m ump run`` reads them."""
    for option in reversed(TABLE.values()):
        kind = click.Choice(option.choices) if option.choices else _OptionType(option)
        command = click.option(option.flag("--ump-"), option.name, type=kind, default=None,
                               help=option.describe())(command)
    return command


def _plugin(**flags) -> UmpPlugin:
    """The plugin the preload installs, for its flags over the environment."""
    backend, options = resolve(flags)
    return UmpPlugin(backend, **options)


@click.command()
@_with_options
async def dask_setup(worker, **flags):
    """Preload entry point: enable ump as the worker starts.

    Only workers enable ump: given to a scheduler or a nanny
    (``--preload-nanny``) it does nothing there.
    """
    from distributed import Worker

    if not isinstance(worker, Worker):
        logger.info("ump.dask preload: %s is not a worker, nothing to do", type(worker).__name__)
        return
    # The same plugin as client.register_plugin installs: one way to enable,
    # and re-registering from a client replaces it under the same name.
    await worker.plugin_add(_plugin(**flags), name=PLUGIN_NAME, catch_errors=False)
