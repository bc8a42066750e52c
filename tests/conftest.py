import sys

import pytest
import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64: one number per tensor, scale-free."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


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
