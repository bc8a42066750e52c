"""The FLA delta-rule op's mechanics on CPU, with pure-torch stand-ins for FLA's kernels.

What runs here is the op's own code: the residuals it returns and saves, its autograd formula,
its fake implementation and the arguments it passes to FLA (checked against FLA 0.6.0's
signatures). The kernels themselves are checked on a GPU (tests/gpu/test_delta_rule_op_gpu.py).
"""

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tests.fla_stand_in import FlaConvStandIn, FlaStandIn
from titan_gdn.ops import conv
from titan_gdn.ops.delta_rule import fla_op, gated_delta_rule

INPUT_NAMES = ("q", "k", "v", "g", "beta")
# A 1-token document, documents across chunk boundaries, then fixed-capacity padding.
CU_SEQLENS = torch.tensor([0, 1, 40, 70, 75, 75, 75], dtype=torch.int32)
TOKENS, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 75, 2, 4, 16


@pytest.fixture
def stand_in(monkeypatch):
    stand_in = FlaStandIn()
    monkeypatch.setattr(fla_op, "load_fla_kernels", stand_in.kernels)
    return stand_in


def _inputs(dtype=torch.float32):
    """q, k, v as the GDN layer passes them: strided slices of one conv output."""
    gen = torch.Generator().manual_seed(0)
    key_dim, value_dim = KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM
    qkv = torch.randn(1, TOKENS, 2 * key_dim + value_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
    return {
        "q": q.unflatten(-1, (KEY_HEADS, HEAD_DIM)),
        "k": k.unflatten(-1, (KEY_HEADS, HEAD_DIM)),
        "v": v.unflatten(-1, (VALUE_HEADS, HEAD_DIM)),
        "g": F.logsigmoid(torch.randn(1, TOKENS, VALUE_HEADS, generator=gen)),  # fp32 always
        "beta": torch.rand(1, TOKENS, VALUE_HEADS, generator=gen).to(dtype),
        "grad_out": torch.randn(1, TOKENS, VALUE_HEADS, HEAD_DIM, generator=gen).to(dtype),
    }


def _output_and_grads(fn, inputs):
    leaves = [inputs[name].detach().requires_grad_() for name in INPUT_NAMES]
    out = fn(*leaves, CU_SEQLENS)
    grads = torch.autograd.grad((out * inputs["grad_out"]).sum(), leaves)
    return {"o": out, **{f"d{name}": grad for name, grad in zip(INPUT_NAMES, grads, strict=True)}}


def _fla(q, k, v, g, beta, cu_seqlens):
    return fla_op.fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale=None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fla_op_matches_the_torch_backend(stand_in, compiled):
    inputs = _inputs()
    expected = _output_and_grads(lambda *args: gated_delta_rule(*args, backend="torch"), _inputs())
    fn = torch.compile(_fla, backend="aot_eager", fullgraph=True) if compiled else _fla
    actual = _output_and_grads(fn, inputs)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype
        assert relative_error(actual[name], value) <= 1e-5, name


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fla_backward_runs_no_forward_kernel(stand_in, compiled):
    fn = torch.compile(_fla, backend="aot_eager", fullgraph=True) if compiled else _fla
    leaves = [x.detach().requires_grad_() for x in list(_inputs().values())[:5]]
    out = fn(*leaves, CU_SEQLENS)
    assert (stand_in.forward_calls, stand_in.backward_calls) == (1, 0)
    out.sum().backward()
    assert (stand_in.forward_calls, stand_in.backward_calls) == (1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_op_passes_opcheck(stand_in, dtype):
    inputs = _inputs(dtype)
    tensors = [inputs[name].detach().requires_grad_() for name in INPUT_NAMES]
    torch.library.opcheck(
        torch.ops.titan_gdn.gated_delta_rule_fla, (*tensors, CU_SEQLENS, HEAD_DIM**-0.5)
    )


def test_fla_op_keeps_low_precision_outputs_and_input_dtypes_for_grads(stand_in):
    inputs = _inputs(torch.bfloat16)
    result = _output_and_grads(_fla, inputs)
    assert result["o"].dtype == torch.bfloat16
    for name in INPUT_NAMES:
        assert result[f"d{name}"].dtype == inputs[name].dtype, name


def test_a_long_row_is_tuned_on_its_first_tokens_before_it_runs(stand_in, monkeypatch):
    """FLA tunes a kernel at its first launch; a long row's first call runs FLA's forward and
    backward on a short row first (the backward's tuning then happens with little memory
    held), once per process and head shape; the row's own results are untouched."""
    lengths = {"forward": [], "backward": []}
    for name in lengths:
        kernel = getattr(stand_in, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            lengths[_name].append(kwargs["q"].shape[1])
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(stand_in, name, counted)
    monkeypatch.setattr(fla_op, "_tuned", set())
    expected = _output_and_grads(_fla, _inputs())  # 75 tokens, not longer than the default
    assert lengths == {"forward": [TOKENS], "backward": [TOKENS]}

    monkeypatch.setattr(fla_op, "TUNING_TOKENS", 16)
    lengths["forward"].clear(), lengths["backward"].clear()
    first = _output_and_grads(_fla, _inputs())
    assert lengths == {"forward": [16, TOKENS], "backward": [16, TOKENS]}
    again = _output_and_grads(_fla, _inputs())
    assert lengths == {"forward": [16, TOKENS, TOKENS], "backward": [16, TOKENS, TOKENS]}
    for name, value in expected.items():
        assert torch.equal(first[name], value) and torch.equal(again[name], value), name


def test_document_chunks_are_fla_s_chunk_indices():
    """The boundaries and chunk indices handed to FLA's conv and delta rule are what FLA
    derives itself (`prepare_chunk_indices`), for fresh random packings with 1-token
    documents, documents across chunk boundaries and the fixed-capacity padding."""
    from fla.ops.utils.index import prepare_chunk_indices

    from titan_gdn.boundaries import FLA_CHUNK_SIZE, DocumentBoundaries, documents_and_chunks

    generator = torch.Generator().manual_seed(torch.seed())
    for _ in range(30):
        rows, length = torch.randint(1, 4, (2,), generator=generator).tolist()
        length *= int(torch.randint(1, 400, (1,), generator=generator))
        tokens = torch.randint(1, 50, (rows, length), generator=generator)
        tokens[tokens < 4] = 0  # EOS
        docs = DocumentBoundaries.from_tokens(tokens, 0)
        cu_seqlens, chunk_indices = documents_and_chunks(docs.padded_cu_seqlens)
        assert torch.equal(cu_seqlens, docs.cu_seqlens)
        expected = prepare_chunk_indices(docs.cu_seqlens.clone(), FLA_CHUNK_SIZE)
        assert chunk_indices.dtype == expected.dtype
        assert torch.equal(chunk_indices, expected)


# 4 taps (every Qwen3.5 config): our backward kernel, no forward rerun; other widths: FLA's
# forward recomputed under autograd and differentiated.
@pytest.mark.parametrize("taps, calls", [(4, (1, 1)), (3, (2, 0))])
def test_fla_conv_op_backward_kernel_for_4_taps_forward_recomputed_for_others(
    monkeypatch, taps, calls
):
    from fla.modules import causal_conv1d as fla_conv

    from titan_gdn.ops import conv_backward

    stand_in = FlaConvStandIn()
    monkeypatch.setattr(fla_conv, "causal_conv1d", stand_in.causal_conv1d)
    monkeypatch.setattr(
        conv_backward, "causal_conv1d_silu_backward", stand_in.causal_conv1d_silu_backward
    )
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(1, TOKENS, 24, generator=gen), torch.randn(24, taps, generator=gen)
    grad = torch.randn(1, TOKENS, 24, generator=gen)
    results = {}
    for backend in ("torch", "fla"):
        leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        out = conv._causal_conv1d_silu_op(*leaves, CU_SEQLENS, backend)
        out.backward(grad)
        results[backend] = (out, *(leaf.grad for leaf in leaves))
    assert (stand_in.forward_calls, stand_in.backward_calls) == calls
    for name, got, want in zip(("out", "dx", "dw"), results["fla"], results["torch"], strict=True):
        assert relative_error(got, want) <= 1e-6, name
