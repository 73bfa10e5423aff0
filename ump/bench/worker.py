"""One configuration's process: set it up, run the suites, print JSON."""

from __future__ import annotations

import json
import os
import sys


def main(argv):
    config, suites, smoke = argv[0], argv[1].split(","), argv[2] == "1"
    backend, _, placement = config.partition(":")
    if backend == "stock":
        # Started by path (python .../worker.py): the cases are read from
        # this folder, and the package ump is never imported.
        os.environ.pop("CUPY_ENABLE_UMP", None)
        import cases
        import progress
    else:
        if backend == "imported":
            os.environ.pop("CUPY_ENABLE_UMP", None)
            import ump  # noqa: F401  (imported, not enabled: the overhead check)
        else:
            import ump

            os.environ["CUPY_ENABLE_UMP"] = "1"
            options = {"placement": placement} if placement else {}
            ump.enable(backend, **options)
        from ump.bench import cases, progress

    results = {}
    for suite in progress.suites_in(config, suites, cases.CONFIG_FREE):
        fn = {**cases.CPU_SUITES, **cases.GPU_SUITES}[suite]
        progress.report("start", suite)
        for case, timing in fn(smoke).items():
            results[case] = {"suite": suite, **timing}
        progress.report("done", suite)
    results["__process__"] = {"ump_imported": "ump" in sys.modules,  # after the suites ran
                              "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else None}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
