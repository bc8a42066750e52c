"""Automatic backend selection skips a package that is installed but does not import."""

import sys

import torch

from titan_gdn.ops.backends import module_available, resolve_backend

CHOICES = ("fast_ext", "fla", "torch")


def _resolve(extension: str) -> str:
    return resolve_backend(
        "conv_backend",
        None,
        torch.device("cuda"),  # selection only looks at the device type
        cuda_preference=("fast_ext", "torch"),
        cuda_only={"fast_ext": extension},
        choices=CHOICES,
    )


def test_a_broken_extension_is_skipped(tmp_path, monkeypatch):
    # Like a CUDA extension built for another torch: found, but its import fails.
    (tmp_path / "broken_ext").mkdir()
    (tmp_path / "broken_ext" / "__init__.py").write_text(
        "raise ImportError('undefined symbol: _ZN3c10')"
    )
    (tmp_path / "missing_dep_ext").mkdir()
    (tmp_path / "missing_dep_ext" / "__init__.py").write_text("import no_such_module_here")
    (tmp_path / "good_ext").mkdir()
    (tmp_path / "good_ext" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("broken_ext", "missing_dep_ext", "good_ext"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    assert not module_available("broken_ext")
    assert not module_available("missing_dep_ext")
    assert not module_available("not_installed_ext")
    assert module_available("good_ext")
    assert _resolve("broken_ext") == "torch"
    assert _resolve("good_ext") == "fast_ext"


def test_selection_inside_a_compiled_block_is_a_constant():
    # Ops resolve their backend when called, i.e. inside each compiled block: the import
    # check must not be traced (dynamo cannot trace importlib) and must not break the graph.
    def shifted(x):
        picked = (_resolve("json"), _resolve("no_such_extension_here"))
        return x + (1.0 if picked == ("fast_ext", "torch") else -1.0)

    compiled = torch.compile(shifted, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))
