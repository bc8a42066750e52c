"""The commands of README.md and docs/*.md work as written.

Every ```bash block on those pages is preceded by a marker comment saying how it is tested:

    <!-- test: cpu -->      run here, verbatim, in a copy of the repository
    <!-- test: gpu -->      needs CUDA: not run in CI
    <!-- test: install -->  installs packages: not run here; CI runs it, line for line, as its
                            install step (.ci/run, checked below)
    <!-- test: skip ... --> not run, the comment says why

The cpu blocks of all pages run in one copy of the checkout (its tracked and untracked,
not ignored files), each page's in page order, so a block may use what an earlier block of
its page wrote (the pages run side by side, so not what another page wrote); a block that
several pages hold (the quickstart, on two pages) runs once. That copy is the one in which
the quickstart ran (tests/conftest.py's `quickstart`, whose exit code it checks and whose
output tests/test_quickstart.py checks), so the quickstart counts as run. Only exit codes
are checked (and the files a recipe promises): the quickstart's output and losses are free
to change.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import QUICKSTART, run_as_a_user

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKED_BLOCK = re.compile(r"<!--\s*test:\s*(\w+)[^>]*-->\s*\n```bash\n(.*?)\n```", re.DOTALL)
ANY_BASH_BLOCK = re.compile(r"^```bash$", re.MULTILINE)
KINDS = {"cpu", "gpu", "install", "skip"}
# Relative links to pages that are being written elsewhere may be missing for a while.
PENDING_LINKS = {"docs/performance.md"}
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)

pytestmark = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="the CPU commands; GPU blocks are marked gpu"
)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(kind, body) for kind, body in MARKED_BLOCK.findall(page.read_text())]


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_every_bash_block_says_how_it_is_tested():
    for page in PAGES:
        text = page.read_text()
        blocks = _blocks(page)
        assert len(ANY_BASH_BLOCK.findall(text)) == len(blocks), (
            f"{_page_id(page)}: a ```bash block without a <!-- test: KIND --> marker"
        )
        for kind, _ in blocks:
            assert kind in KINDS, f"{_page_id(page)}: unknown marker kind {kind!r}"


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
                uneven.append(f"{_page_id(page)}: {header} cells in the header, {line}")
    assert not uneven, uneven


def test_the_written_pages_name_no_commit():
    named = [
        f"{_page_id(page)}: {match.group(0)}"
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
        (page, body) for page in PAGES for kind, body in _blocks(page) if kind == "install"
    ]
    assert install_blocks
    for page, body in install_blocks:
        missing = [command for command in _commands(body) if command not in ci_lines]
        assert not missing, f"{_page_id(page)}: .ci/run does not run {missing}"


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
                missing.append(f"{_page_id(page)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                missing.append(f"{_page_id(page)} -> {target}#{anchor}")
    assert not missing, missing


def _cpu_blocks(page: Path) -> list[str]:
    return [body for kind, body in _blocks(page) if kind == "cpu"]


CPU_PAGES = [page for page in PAGES if _cpu_blocks(page)]


def _run_block(root: Path, body: str) -> tuple[int, str]:
    """A block in `root` as a user runs it from a shell: (exit code, output)."""
    return run_as_a_user(["bash", "-e", "-o", "pipefail", "-c", body], root)


# What a block promises on disk, checked after it ran: (text in the block, path).
PROMISED_FILES = [
    ("titan_gdn.tiny_hf_checkpoint", "hf_model/model.safetensors"),
    ("--checkpoint.last_save_in_hf", "outputs/finetune/checkpoint/step-20/config.json"),
    ("--checkpoint.create_seed_checkpoint", "outputs/seed/checkpoint/step-0/.metadata"),
]


@pytest.fixture(scope="module")
def page_runs(quickstart) -> dict[Path, list]:
    """Every cpu page's blocks, run in the quickstart's copy of the checkout: a page's blocks
    one after the other, the pages side by side (a page's run of one process leaves a core
    free most of the time). {page: [(block, (exit code, output), {promised file: written})]} for the
    blocks the page ran, up to its first failure, each promised file looked for right after
    its block; a block that an earlier page holds too runs there, and the page waits for it."""
    root, _ = quickstart
    owner, done = {}, {}
    for page in CPU_PAGES:
        for body in _cpu_blocks(page):
            owner.setdefault(body, page)
            done.setdefault(body, threading.Event())
    done[QUICKSTART] = threading.Event()
    done[QUICKSTART].set()

    def run_page(page: Path) -> list:
        ran = []
        try:
            for body in _cpu_blocks(page):
                if body == QUICKSTART or owner[body] != page:
                    done[body].wait()
                    continue
                result = _run_block(root, body)
                promised = [file for flag, file in PROMISED_FILES if flag in body]
                ran.append((body, result, {file: (root / file).exists() for file in promised}))
                done[body].set()
                if result[0] != 0:
                    break
        finally:  # a page that stopped early holds up no other
            for body in _cpu_blocks(page):
                if owner[body] == page:
                    done[body].set()
        return ran

    with ThreadPoolExecutor(len(CPU_PAGES)) as pages:
        return dict(zip(CPU_PAGES, pages.map(run_page, CPU_PAGES), strict=True))


@pytest.mark.parametrize("page", CPU_PAGES, ids=_page_id)
def test_cpu_commands_of_the_page_run(page_runs, page):
    for body, (code, output), promised_files in page_runs[page]:
        assert code == 0, f"{_page_id(page)}:\n{body}\n--- output ---\n{output[-6000:]}"
        for promised, written in promised_files.items():
            assert written, f"{body}\ndid not write {promised}"
