"""Documentation generated from test results stays what the results say."""

from __future__ import annotations

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_interop_table_is_generated_from_the_gpu_results():
    tool = runpy.run_path(str(ROOT / "tools" / "interop_table.py"))
    doc = (ROOT / "docs" / "interop.md").read_text()
    machine = doc.split("observed on ", 1)[1].split(": whether", 1)[0]
    with open(ROOT / "docs" / "interop-results.jsonl") as f:
        assert tool["render"](f, machine) == doc, "regenerate docs/interop.md with tools/interop_table.py"
