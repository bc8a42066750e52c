"""The FlashQLA delta-rule op on CUDA in bf16, against the torch backend in fp32.

FlashQLA is optional (`model.delta_rule_backend = "flash_qla"`): these tests need it installed
as well as a Hopper or Blackwell GPU. One long document (FlashQLA splits it across the GPU) and
many short ones (it does not) take different kernels; the model's fixed-capacity boundaries
(empty documents at the end) go in as the model passes them. Compiled, the op is one graph
node whose results are eager's (to bf16 rounding: FlashQLA's backward may sum in any order).
"""

import pytest
import torch

from tests.conftest import relative_error
from tests.gpu.test_delta_rule_gpu import INPUT_NAMES, output_and_grads, random_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def flash_qla_installed():
    # In the tests, not at import: collecting this file on a machine without it (CI) skips
    # nothing, the gpu marker deselects the tests there.
    pytest.importorskip("flash_qla", reason="FlashQLA is an optional backend")


LAYOUTS = pytest.mark.parametrize(
    ("tokens", "documents", "key_heads", "value_heads"),
    [(8192, 2, 16, 32), (8192, 300, 16, 16), (300, 5, 1, 2)],
    ids=["long-document", "many-documents", "small"],
)


def _padded(inputs):
    cu_seqlens = inputs["cu_seqlens"]
    tokens = inputs["q"].shape[1]
    padding = cu_seqlens[-1:].expand(tokens + 1 - len(cu_seqlens))
    return {**inputs, "cu_seqlens": torch.cat([cu_seqlens, padding])}


@LAYOUTS
def test_flash_qla_matches_the_fp32_reference(tokens, documents, key_heads, value_heads):
    inputs = _padded(random_inputs(documents, tokens, documents, key_heads, value_heads, 128))
    as_fp32 = {name: x.float() if x.is_floating_point() else x for name, x in inputs.items()}
    reference = output_and_grads(as_fp32, "torch")
    result = output_and_grads(inputs, "flash_qla")
    errors = {name: relative_error(result[name], reference[name]) for name in reference}
    print("flash_qla bf16 vs torch fp32: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(error <= 1e-2 for error in errors.values()), errors
    assert result["o"].dtype == torch.bfloat16 and result["dg"].dtype == torch.float32


def test_compiled_flash_qla_equals_eager():
    from titan_gdn.ops.delta_rule import gated_delta_rule

    inputs = _padded(random_inputs(7, 4096, 3, 16, 32, 128))

    def run(fn):
        leaves = [inputs[name].clone().requires_grad_() for name in INPUT_NAMES]
        out = fn(*leaves, inputs["cu_seqlens"])
        grads = torch.autograd.grad((out.float() * inputs["grad_out"].float()).sum(), leaves)
        return [out, *grads]

    def layer(q, k, v, g, beta, cu_seqlens):
        return gated_delta_rule(q, k, v, g, beta, cu_seqlens, backend="flash_qla") * 2

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True))
    errors = [relative_error(c, e) for e, c in zip(eager, compiled, strict=True)]
    assert max(errors) <= 1e-3, errors
