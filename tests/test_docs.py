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


def test_the_guide_shows_the_option_table():
    from ump._options import TABLE, markdown

    guide = (ROOT / "docs" / "guide.md").read_text()
    assert markdown() in guide, "paste ump._options.markdown() into docs/guide.md's Options section"
    assert all(f"`{option.env}`" in guide for option in TABLE.values())  # UMP_PREFETCH_MIN among them


def test_every_page_is_linked_and_the_site_has_a_home():
    import re

    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert "index.md" in pages and all(f": {page}" in nav for page in pages)
    for page in pages:
        text = re.sub(r"```.*?```|`[^`\n]*`", "", (ROOT / "docs" / page).read_text(), flags=re.S)
        # a page named in prose is a link: docs/x.md outside a link is a reference a reader cannot follow
        assert not re.findall(r"(?<![\[(/])docs/[a-z-]+\.md(?![)\]])", text), page
