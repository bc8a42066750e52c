"""titan_gdn's modules import each other without cycles, imports inside functions included: a
cycle hidden in a function-level import still couples the two modules (model args must stay
data that the parallel and FLOP-counting code read, not code that calls back into them)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titan_gdn"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """The project modules a file imports anywhere in it; `from package import name` counts as
    an import of the submodule `package.name` when there is one, else of the package."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found & modules


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in package.rglob("*.py")}
    return {
        name: _imported(ast.parse(path.read_text()), set(files)) - {name}
        for name, path in files.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _outside_the_model_package(graph: dict[str, set[str]]) -> set[str]:
    """What model args reach beyond `titan_gdn.model`'s own modules and the settings schema
    (`titan_gdn.job_config`, which imports nothing)."""
    reached = _reachable(graph, "titan_gdn.model.args")
    return {m for m in reached if not m.startswith("titan_gdn.model.")} - {"titan_gdn.job_config"}


def test_no_import_cycles_between_titan_gdn_modules():
    assert _cycles(_graph()) == []


def test_the_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_model_args_import_nothing_from_the_package_above_them():
    """Model args are data: the flavors, the HF config mapping and the job checks sit beside
    them in titan_gdn.model; what gathers the checks or builds and runs the model is above."""
    assert _outside_the_model_package(_graph()) == set()


def test_the_check_finds_model_args_reaching_above_the_model_package():
    graph = {
        "titan_gdn.model.args": {"titan_gdn.model.job_checks", "titan_gdn.job_config"},
        "titan_gdn.model.job_checks": {"titan_gdn.validation"},
    }
    assert _outside_the_model_package(graph) == {"titan_gdn.validation"}
