"""FLA vs the torch backend on CUDA in bf16, both judged against the torch backend in fp32.

Needs a CUDA device: CI deselects it with ``-m "not gpu"``.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from titan_gdn.ops.delta_rule import gated_delta_rule

pytestmark = pytest.mark.gpu

INPUT_NAMES = ("q", "k", "v", "g", "beta")
LOW_PRECISION = ("q", "k", "v", "beta", "grad_out")


def random_bounds(gen, tokens, documents):
    """Document boundaries with a 1-token first document and random cuts elsewhere."""
    cuts = (torch.randperm(tokens - 2, generator=gen)[: documents - 2] + 2).sort().values
    return torch.tensor([0, 1, *cuts.tolist(), tokens], dtype=torch.int32)


def random_inputs(seed, tokens, documents, key_heads, value_heads, head_dim):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    inputs = {
        "q": randn(1, tokens, key_heads, head_dim),
        "k": randn(1, tokens, key_heads, head_dim),
        "v": randn(1, tokens, value_heads, head_dim),
        "g": F.logsigmoid(2 * randn(1, tokens, value_heads)),
        "beta": torch.sigmoid(randn(1, tokens, value_heads)),
        "grad_out": randn(1, tokens, value_heads, head_dim),
        "cu_seqlens": random_bounds(gen, tokens, documents),
    }
    inputs = {name: x.cuda() for name, x in inputs.items()}
    # g stays fp32, as the GDN layer computes it.
    return {name: x.bfloat16() if name in LOW_PRECISION else x for name, x in inputs.items()}


def output_and_grads(inputs, backend):
    leaves = [inputs[name].clone().requires_grad_() for name in INPUT_NAMES]
    out = gated_delta_rule(*leaves, inputs["cu_seqlens"], backend=backend)
    grads = torch.autograd.grad((out.float() * inputs["grad_out"].float()).sum(), leaves)
    return {"o": out, **{f"d{name}": grad for name, grad in zip(INPUT_NAMES, grads, strict=True)}}


@pytest.fixture(scope="module", autouse=True)
def report_environment():
    import fla
    import triton

    from titan_gdn.ops.delta_rule.hopper_guard import allow_fla_hopper_bk128

    lifted = allow_fla_hopper_bk128()
    major, minor = torch.cuda.get_device_capability()
    print(
        f"\n{torch.cuda.get_device_name()} sm_{major}{minor}"
        f", torch {torch.__version__}, triton {triton.__version__}, fla {fla.__version__}"
        f", Hopper BK=128 guard lift installed: {lifted}"
    )


@pytest.mark.parametrize(
    ("tokens", "documents", "key_heads", "value_heads", "head_dim"),
    [(300, 5, 1, 2, 128), (8192, 17, 16, 32, 128)],
    ids=["small", "qwen3.5-size"],
)
def test_fla_matches_torch_backend_in_bf16(tokens, documents, key_heads, value_heads, head_dim):
    inputs = random_inputs(tokens, tokens, documents, key_heads, value_heads, head_dim)
    as_fp32 = {name: x.float() if x.is_floating_point() else x for name, x in inputs.items()}
    reference = output_and_grads(as_fp32, "torch")
    errors = {}
    for backend in ("fla", "torch"):
        result = output_and_grads(inputs, backend)
        errors[backend] = {
            name: relative_error(result[name], reference[name]) for name in reference
        }
        print(
            f"{backend} bf16 vs torch fp32: "
            + ", ".join(f"{name} {error:.2e}" for name, error in errors[backend].items())
        )
    assert all(error <= 1e-2 for row in errors.values() for error in row.values()), errors
