"""Automatic backend selection skips a package that is installed but does not import; FLA's
own backend dispatch is off once titan_gdn is imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_gdn.ops.attention import resolve_attn_backend
from titan_gdn.ops.backends import module_available, resolve_backend

CHOICES = ("fast_ext", "fla", "torch")
REPO_ROOT = Path(__file__).resolve().parents[1]


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


def test_attention_on_cuda_in_fp32_asks_for_a_backend_that_takes_it():
    cuda = torch.device("cuda")  # selection only looks at the device type
    assert resolve_attn_backend(cuda, None, torch.bfloat16) == "varlen"
    assert resolve_attn_backend(cuda, None, torch.float16) == "varlen"
    assert resolve_attn_backend(cuda, None) == "varlen"  # masks, built before autocast
    assert resolve_attn_backend(cuda, "flex", torch.float32) == "flex"
    assert resolve_attn_backend(torch.device("cpu"), None, torch.float32) == "sdpa"
    # torch's flash and cuDNN kernels take 16-bit inputs only.
    for backend in (None, "varlen"):
        with pytest.raises(ValueError, match=r"torch.float32.*model.attn_backend = 'flex'"):
            resolve_attn_backend(cuda, backend, torch.float32)


def _fla_dispatch_disabled(env: dict) -> bool:
    # A fresh interpreter: FLA reads the variable once, when it is first imported.
    code = "import titan_gdn, fla.backends; print(fla.backends._DISPATCH_DISABLED)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip().splitlines()[-1] == "True"


def test_importing_titan_gdn_turns_fla_backend_dispatch_off_unless_asked_for():
    env = {k: v for k, v in os.environ.items() if k != "FLA_DISABLE_BACKEND_DISPATCH"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    assert _fla_dispatch_disabled(env)
    assert not _fla_dispatch_disabled({**env, "FLA_DISABLE_BACKEND_DISPATCH": "0"})
