"""titan_gdn's modules import each other without cycles and only downward through the floors,
imports inside functions included: a cycle or an upward import hidden in a function-level import
still couples the two modules (model args must stay data that the parallel and FLOP-counting code
read, not code that calls back into them)."""

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


# The floors, lowest first: a module imports from its own floor or the ones below. A module's
# floor is that of the longest prefix listed; the top floor (setup of a run: trainer, data,
# checkpoints, config checks) holds the rest.
FLOORS = [
    (
        "ground: document boundaries, model args as data",
        [
            "titan_gdn.boundaries",
            "titan_gdn.model.args",
            "titan_gdn.model.hf_config",
            "titan_gdn.model.hf_files",
            "titan_gdn.model.job_checks",
            "titan_gdn.model.flops",
            "titan_gdn.model.layer_types",
            "titan_gdn.job_config",
            "titan_gdn.cpu",
            "titan_gdn.config_check",
        ],
    ),
    ("ops", ["titan_gdn.ops"]),
    ("placements the forward calls", ["titan_gdn.placements"]),
    ("layers", ["titan_gdn.layers"]),
    ("model", ["titan_gdn.model", "titan_gdn.loss"]),
    ("parallel setup", ["titan_gdn.parallel"]),
    ("run setup and trainer", ["titan_gdn"]),
]


def _floor(module: str, floors=FLOORS) -> int:
    matches = [
        (len(prefix), level)
        for level, (_, prefixes) in enumerate(floors)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1]


def _upward_imports(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    return [
        f"{module} ({floors[_floor(module, floors)][0]}) imports {target} "
        f"({floors[_floor(target, floors)][0]})"
        for module in sorted(graph)
        for target in sorted(graph[module])
        if _floor(target, floors) > _floor(module, floors)
    ]


def test_titan_gdn_modules_import_only_down_the_floors():
    assert _upward_imports(_graph()) == []


def test_the_check_finds_an_upward_import():
    floors = [("ground", ["pkg.ground"]), ("ops", ["pkg.ops"]), ("top", ["pkg"])]
    graph = {"pkg.ops.conv": {"pkg.ground"}, "pkg.ground": {"pkg.ops.conv"}, "pkg.train": set()}
    assert _upward_imports(graph, floors) == ["pkg.ground (ground) imports pkg.ops.conv (ops)"]


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
