"""The bash blocks of README.md and docs/*.md, and how each says it is tested.

Every ```bash block on those pages is preceded by a marker comment saying how it is tested:

    <!-- test: cpu -->      run here, verbatim, in a copy of the repository
                            (tests/test_quickstart.py, in the quickstart's copy)
    <!-- test: gpu -->      needs CUDA: not run in CI
    <!-- test: install -->  installs packages: not run here; CI runs it, line for line, as its
                            install step (.ci/run, checked by tests/test_docs_commands.py)
    <!-- test: skip ... --> not run, the comment says why
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKED_BLOCK = re.compile(r"<!--\s*test:\s*(\w+)[^>]*-->\s*\n```bash\n(.*?)\n```", re.DOTALL)
KINDS = {"cpu", "gpu", "install", "skip"}


def blocks(page: Path) -> list[tuple[str, str]]:
    """(kind, body) of each marked bash block of `page`, in page order."""
    return [(kind, body) for kind, body in MARKED_BLOCK.findall(page.read_text())]


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def cpu_blocks(page: Path) -> list[str]:
    return [body for kind, body in blocks(page) if kind == "cpu"]


CPU_PAGES = [page for page in PAGES if cpu_blocks(page)]
