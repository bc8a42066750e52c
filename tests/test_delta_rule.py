"""The gated delta rule: chunked torch vs the token recurrence, transformers, and backend rules."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from titan_gdn.ops.delta_rule import (
    DELTA_RULE_BACKENDS,
    gated_delta_rule,
    hopper_guard,
    resolve_delta_rule_backend,
)
from titan_gdn.ops.delta_rule.chunk_torch import chunk_gated_delta_rule_torch
from titan_gdn.ops.delta_rule.naive import recurrent_gated_delta_rule

# One document of 1 token, several not a multiple of 64, two longer than 128: T = 400.
DOCUMENT_LENGTHS = (1, 63, 1, 130, 70, 135)
INPUT_NAMES = ("q", "k", "v", "g", "beta")


def random_inputs(seed, lengths, key_heads, value_heads, key_dim, value_dim, dtype, decay=1.0):
    """Packed-document inputs as the GDN layer produces them (g <= 0, beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return {
        "q": randn(1, tokens, key_heads, key_dim),
        "k": randn(1, tokens, key_heads, key_dim),
        "v": randn(1, tokens, value_heads, value_dim),
        "g": decay * F.logsigmoid(2 * randn(1, tokens, value_heads)),
        "beta": torch.sigmoid(randn(1, tokens, value_heads)),
        "cu_seqlens": torch.tensor((0, *lengths)).cumsum(0).to(torch.int32),
        "grad_out": randn(1, tokens, value_heads, value_dim),
    }


def output_and_grads(fn, inputs, **kwargs):
    """fn's output and the gradients of <output, grad_out> with respect to q, k, v, g, beta."""
    leaves = [inputs[name].clone().requires_grad_() for name in INPUT_NAMES]
    out = fn(*leaves, inputs["cu_seqlens"], **kwargs)
    grads = torch.autograd.grad((out * inputs["grad_out"]).sum(), leaves)
    return {"o": out, **{f"d{name}": grad for name, grad in zip(INPUT_NAMES, grads, strict=True)}}


def assert_all_close(actual, expected, tolerance, label):
    errors = {name: relative_error(actual[name], expected[name]) for name in expected}
    print(f"{label}: " + ", ".join(f"{name} {error:.2e}" for name, error in errors.items()))
    assert all(error <= tolerance for error in errors.values()), errors


def as_float64(inputs):
    return {name: x.double() if x.is_floating_point() else x for name, x in inputs.items()}


@pytest.fixture(scope="module")
def packed_case():
    """fp32 inputs and the fp64 token recurrence on them, computed once: the recurrence is slow."""
    inputs = random_inputs(0, DOCUMENT_LENGTHS, 2, 4, 32, 16, torch.float32)
    return inputs, output_and_grads(recurrent_gated_delta_rule, as_float64(inputs))


@pytest.mark.parametrize(
    ("dtype", "chunk_size", "tolerance"),
    [(torch.float64, 64, 1e-12), (torch.float64, 16, 1e-12), (torch.float32, 64, 1e-5)],
)
def test_chunked_matches_token_recurrence(packed_case, dtype, chunk_size, tolerance):
    inputs, expected = packed_case
    inputs = {name: x.to(dtype) if x.is_floating_point() else x for name, x in inputs.items()}
    actual = output_and_grads(chunk_gated_delta_rule_torch, inputs, chunk_size=chunk_size)
    assert_all_close(actual, expected, tolerance, f"chunked {dtype} C={chunk_size} vs recurrence")


def test_chunked_keeps_fp32_accuracy_under_strong_decay():
    # Log-decays of tens per token: exp() underflows across a chunk and the cumulative sums are
    # large, so differences of them lose fp32 digits unless formed carefully.
    inputs = random_inputs(1, (200, 57), 2, 4, 16, 16, torch.float32, decay=30.0)
    expected = output_and_grads(recurrent_gated_delta_rule, as_float64(inputs))
    actual = output_and_grads(chunk_gated_delta_rule_torch, inputs)
    assert_all_close(actual, expected, 1e-6, "strong decay, fp32 vs fp64 recurrence")


def test_single_document_matches_transformers(hf_qwen3_5):
    inputs = random_inputs(2, (300,), 2, 4, 32, 32, torch.float32)

    def transformers_rule(q, k, v, g, beta, cu_seqlens):
        out, _ = hf_qwen3_5.torch_chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True
        )
        return out

    expected = output_and_grads(transformers_rule, inputs)
    actual = output_and_grads(gated_delta_rule, inputs, backend="torch")
    assert_all_close(actual, expected, 1e-5, "torch backend vs transformers")


def test_changing_one_document_leaves_the_others_bit_identical():
    inputs = random_inputs(3, DOCUMENT_LENGTHS, 2, 4, 32, 16, torch.float32)
    bounds = inputs["cu_seqlens"].tolist()
    changed = random_inputs(4, DOCUMENT_LENGTHS, 2, 4, 32, 16, torch.float32)
    start, end = bounds[3], bounds[4]
    edited = {
        name: torch.cat([x[:, :start], changed[name][:, start:end], x[:, end:]], dim=1)
        for name, x in inputs.items()
        if name in INPUT_NAMES
    }
    cu_seqlens = inputs["cu_seqlens"]
    before = gated_delta_rule(*[inputs[name] for name in INPUT_NAMES], cu_seqlens, backend="torch")
    after = gated_delta_rule(*[edited[name] for name in INPUT_NAMES], cu_seqlens, backend="torch")
    assert torch.equal(before[:, :start], after[:, :start])
    assert torch.equal(before[:, end:], after[:, end:])
    assert not torch.equal(before[:, start:end], after[:, start:end])


def test_empty_documents_change_nothing():
    inputs = random_inputs(9, (10, 65), 1, 2, 16, 16, torch.float32)
    args = [inputs[name] for name in INPUT_NAMES]
    with_empty = torch.tensor([0, 0, 10, 10, 75, 75], dtype=torch.int32)
    expected = gated_delta_rule(*args, inputs["cu_seqlens"], backend="torch")
    assert torch.equal(gated_delta_rule(*args, with_empty, backend="torch"), expected)


def test_output_keeps_the_value_dtype():
    inputs = random_inputs(5, (70, 10), 1, 2, 16, 16, torch.float32)
    low = {name: inputs[name].to(torch.bfloat16) for name in ("q", "k", "v", "beta")}
    out = gated_delta_rule(
        low["q"], low["k"], low["v"], inputs["g"], low["beta"], inputs["cu_seqlens"]
    )
    assert out.dtype == torch.bfloat16 and out.shape == inputs["v"].shape


@pytest.mark.parametrize("requested", [None, "auto", "torch"])
def test_cpu_resolves_to_torch(requested):
    assert resolve_delta_rule_backend(torch.device("cpu"), requested) == "torch"


def test_fla_on_cpu_names_the_setting():
    with pytest.raises(ValueError, match="delta_rule_backend"):
        resolve_delta_rule_backend(torch.device("cpu"), "fla")


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError) as error:
        resolve_delta_rule_backend(torch.device("cpu"), "cuda_magic")
    assert all(name in str(error.value) for name in DELTA_RULE_BACKENDS)


def test_batch_of_two_is_refused():
    inputs = random_inputs(6, (10,), 1, 1, 8, 8, torch.float32)
    batched = [torch.cat([inputs[name]] * 2) for name in INPUT_NAMES]
    with pytest.raises(ValueError, match="batch size 1"):
        gated_delta_rule(*batched, inputs["cu_seqlens"])


def test_value_heads_must_be_a_multiple_of_key_heads():
    inputs = random_inputs(7, (10,), 2, 3, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule(*[inputs[name] for name in INPUT_NAMES], inputs["cu_seqlens"])


def test_cu_seqlens_must_cover_the_row():
    inputs = random_inputs(8, (10, 5), 1, 1, 8, 8, torch.float32)
    short = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="end at T=15"):
        gated_delta_rule(*[inputs[name] for name in INPUT_NAMES], short)


@pytest.mark.parametrize(
    ("capability", "key_dim", "value_dim", "lifted"),
    [
        ((9, 0), 128, 128, True),
        ((9, 0), 96, 256, True),
        ((9, 0), 64, 128, False),  # BK = 64: the miscompiled tile of fla #640
        ((9, 0), 128, 64, False),
        ((9, 0), 32, 32, False),
        ((8, 0), 128, 128, False),
        ((10, 0), 128, 128, False),
    ],
)
def test_hopper_guard_is_lifted_only_for_128_wide_tiles(capability, key_dim, value_dim, lifted):
    assert hopper_guard.guard_may_be_lifted(capability, key_dim, value_dim) is lifted


def test_hopper_guard_lift_is_scoped_to_one_call(monkeypatch):
    chunk_o = SimpleNamespace(TRITON_ABOVE_3_7_1=False, check_shared_mem=lambda arch, index: True)

    def guarded_dqkwg(q, k, v, **kwargs):
        if not chunk_o.TRITON_ABOVE_3_7_1:
            raise RuntimeError("see #640")
        return "ran"

    monkeypatch.setattr(hopper_guard, "_device_capability", lambda device: (9, 0))
    dqkwg = hopper_guard.lift_guard_for_safe_tiles(guarded_dqkwg, chunk_o)
    assert dqkwg(q=None, k=torch.empty(1, 1, 1, 128), v=torch.empty(1, 1, 1, 128)) == "ran"
    assert chunk_o.TRITON_ABOVE_3_7_1 is False
    with pytest.raises(RuntimeError, match="#640"):
        dqkwg(q=None, k=torch.empty(1, 1, 1, 64), v=torch.empty(1, 1, 1, 128))
