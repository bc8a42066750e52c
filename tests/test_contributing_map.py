"""CONTRIBUTING's map of the places a new mixer family or context-parallel mode touches names
files that exist and names that those files define: the map follows the code when it moves."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Adding a mixer family or a context-parallel mode"
ROW = re.compile(r"^\| `([^`]+)` \| `([A-Za-z_][A-Za-z0-9_]*)` \|", re.M)


def _section(text: str) -> str:
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else None]


def _defines(source: str, name: str) -> bool:
    """A def, class, assignment or dataclass field of `name` at any indentation."""
    pattern = rf"^\s*(def {name}\b|class {name}\b|{name}\s*[:=])"
    return re.search(pattern, source, re.M) is not None


def map_problems(text: str, repo: Path) -> list[str]:
    problems = []
    for path, name in ROW.findall(_section(text)):
        file = repo / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
        elif not _defines(file.read_text(), name):
            problems.append(f"{path}: defines no {name}")
    return problems


def test_every_place_of_the_map_is_in_the_code():
    text = (REPO / "CONTRIBUTING.md").read_text()
    assert len(ROW.findall(_section(text))) >= 15
    assert map_problems(text, REPO) == []


def test_the_check_finds_a_moved_file_and_a_renamed_name(tmp_path):
    (tmp_path / "a.py").write_text("class Kept:\n    field: int = 0\n")
    text = (
        f"{SECTION}\n\n| file | name | what |\n|---|---|---|\n"
        "| `a.py` | `Kept` | x |\n| `a.py` | `field` | x |\n"
        "| `a.py` | `Renamed` | x |\n| `b.py` | `Gone` | x |\n\n## Next\n| `c.py` | `X` | x |\n"
    )
    assert map_problems(text, tmp_path) == ["a.py: defines no Renamed", "b.py: no such file"]
