import sys

import pytest
import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64: one number per tensor, scale-free."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def perturb_norms_and_gates(model: torch.nn.Module, scale: float = 0.3) -> None:
    """Move norm weights and dt_bias off their init values (0 or 1), so that a wrong (1 + w)
    convention or a wrong slice of a per-head parameter shows in the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(scale * torch.randn_like(param))


@pytest.fixture(scope="session")
def hf_qwen3_5():
    """transformers' Qwen3.5 module on its pure-torch path (FLA hidden while it is imported)."""
    saved = {
        name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "fla"
    }
    # The kernel choice is made when the module is imported: import it afresh with FLA hidden.
    for name in [n for n in sys.modules if n.startswith("transformers.models.qwen3_5")]:
        del sys.modules[name]
    sys.modules["fla"] = None
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5

        return modeling_qwen3_5
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
