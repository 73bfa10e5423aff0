"""pytest plugin for CuPy's own test suite: enable ump when pytest loads it.

It must act at import, not in a hook: CuPy's pytest settings name warning
classes in cupy.exceptions, so pytest imports CuPy while it applies them,
before any conftest or configure hook runs, and ump must put its hooks in
before CuPy is imported. Used by tools/cupy_suite.py (-p ump_cupy_plugin).
"""

import os

import ump

ump.enable(os.environ.get("UMP_SUITE_BACKEND", "auto"),
           cap=int(os.environ.get("UMP_CUPY_SUITE_CAP", str(4 << 30))))
