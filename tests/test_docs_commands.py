"""The pages' commands as written: every bash block says how it is tested (tests/doc_pages.py;
the cpu blocks run in tests/test_quickstart.py, after the quickstart, in its copy), CI installs
as the install blocks say, tables are even, links lead to files and headings, and the
hand-written pages name no commit.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.doc_pages import KINDS, PAGES, REPO, blocks, page_id

ANY_BASH_BLOCK = re.compile(r"^```bash$", re.MULTILINE)
# Relative links to pages that are being written elsewhere may be missing for a while.
PENDING_LINKS = {"docs/performance.md"}
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)


def test_every_bash_block_says_how_it_is_tested():
    for page in PAGES:
        text = page.read_text()
        marked = blocks(page)
        assert len(ANY_BASH_BLOCK.findall(text)) == len(marked), (
            f"{page_id(page)}: a ```bash block without a <!-- test: KIND --> marker"
        )
        for kind, _ in marked:
            assert kind in KINDS, f"{page_id(page)}: unknown marker kind {kind!r}"


# The hand-written pages (docs/performance.md is generated from docs/results/).
WRITTEN_PAGES = [REPO / "CONTRIBUTING.md", *(p for p in PAGES if p.name != "performance.md")]
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
CODE_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _table_cells(row: str) -> int:
    """The cells of a markdown table row; `|` inside backticks or escaped is text."""
    text = re.sub(r"`[^`]*`|\\\|", "x", row.strip())
    return len(text.strip("|").split("|"))


def test_every_table_row_has_the_cells_of_its_header():
    uneven = []
    for page in [REPO / "CONTRIBUTING.md", *PAGES]:
        lines = CODE_FENCE.sub("", page.read_text()).splitlines()
        header = None
        for line in lines:
            if not line.startswith("|"):
                header = None
            elif header is None:
                header = _table_cells(line)
            elif _table_cells(line) != header:
                uneven.append(f"{page_id(page)}: {header} cells in the header, {line}")
    assert not uneven, uneven


def test_the_written_pages_name_no_commit():
    named = [
        f"{page_id(page)}: {match.group(0)}"
        for page in WRITTEN_PAGES
        for match in COMMIT_HASH.finditer(page.read_text())
    ]
    assert not named, named


def _commands(body: str) -> list[str]:
    """The command lines of a block, without comments."""
    lines = (line.split(" #", 1)[0].strip() for line in body.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_installs_as_the_install_blocks_say():
    ci_lines = set(_commands((REPO / ".ci" / "run").read_text()))
    install_blocks = [
        (page, body) for page in PAGES for kind, body in blocks(page) if kind == "install"
    ]
    assert install_blocks
    for page, body in install_blocks:
        missing = [command for command in _commands(body) if command not in ci_lines]
        assert not missing, f"{page_id(page)}: .ci/run does not run {missing}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of `page`."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    slugs = set()
    for heading in HEADING.findall(text):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_relative_links_point_at_files_and_headings():
    missing = []
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target).resolve() if target else page
            if str(path.relative_to(REPO)) in PENDING_LINKS and not path.exists():
                continue
            if not path.exists():
                missing.append(f"{page_id(page)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                missing.append(f"{page_id(page)} -> {target}#{anchor}")
    assert not missing, missing
