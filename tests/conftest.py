import copy

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


def perturbed_debug_model(**overrides):
    """The debug flavor (with `overrides` of its args), initialised from seed 0, with norms and
    gates moved off their init."""
    from titan_gdn.model import Qwen35Model, qwen3_5_args

    torch.manual_seed(0)
    args = copy.deepcopy(qwen3_5_args["debugmodel"])
    for name, value in overrides.items():
        setattr(args, name, value)
    model = Qwen35Model(args)
    model.init_weights()
    perturb_norms_and_gates(model)
    return model


@pytest.fixture(scope="session")
def hf_qwen3_5():
    """transformers' Qwen3.5 module on its pure-torch path (FLA hidden while it is imported)."""
    from benchmarks.references import transformers_qwen3_5_module

    return transformers_qwen3_5_module(torch_path=True)
