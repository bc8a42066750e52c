"""The delta rule of a sequence cut into chunks, on one process: the chunked torch rule with an
initial state and its final state, and the chunks' summaries chained into the state entering
each chunk, against the fp64 token recurrence over the whole sequence."""

import pytest
import torch

from tests.test_delta_rule import (
    INPUT_NAMES,
    as_float64,
    assert_all_close,
    output_and_grads,
    random_inputs,
)
from titan_gdn.boundaries import padded_cu_seqlens
from titan_gdn.ops.delta_rule.chunk_torch import chunk_gated_delta_rule_torch_with_states
from titan_gdn.ops.delta_rule.naive import recurrent_gated_delta_rule
from titan_gdn.ops.delta_rule.state_passing import (
    add_incoming_state,
    affine_gated_delta_rule,
    incoming_states,
)

# T = 400: documents cross the chunk boundaries at 100 and 300 (cp = 4), one starts exactly at
# 200, one holds the whole chunk 300..400 and one token documents sit at the start.
DOCUMENT_LENGTHS = (1, 63, 1, 135, 200)


@pytest.fixture(scope="module")
def case():
    inputs = random_inputs(5, DOCUMENT_LENGTHS, 2, 4, 16, 8, torch.float32)
    return inputs, output_and_grads(recurrent_gated_delta_rule, as_float64(inputs))


def _chunked(chunks):
    """The whole sequence's output from `chunks` chunks, each run as a rank runs its own."""

    def rule(q, k, v, g, beta, cu_seqlens):
        tokens = q.shape[1]
        size = tokens // chunks
        document = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(tokens), right=True)
        outputs, summaries = [], []
        for n in range(chunks):
            ids = document[n * size : (n + 1) * size]
            starts = torch.cat([torch.ones(1, dtype=torch.bool), ids[1:] != ids[:-1]])[None]
            parts = [x[:, n * size : (n + 1) * size] for x in (q, k, v, g, beta)]
            out, summary = affine_gated_delta_rule(*parts, padded_cu_seqlens(starts), 1, None)
            outputs.append(out)
            summaries.append(summary)
        carry = torch.zeros(chunks, 1)
        carry[1:, 0] = (document[size::size] == document[size - 1 : -1 : size]).float()
        summaries = torch.stack(summaries)
        return torch.cat(
            [
                add_incoming_state(o, incoming_states(summaries, carry, n))
                for n, o in enumerate(outputs)
            ],
            dim=1,
        )

    return rule


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_chunks_with_carried_states_equal_the_whole_sequence(case, chunks):
    inputs, expected = case
    actual = output_and_grads(_chunked(chunks), inputs)
    assert_all_close(actual, expected, 1e-5, f"{chunks} chunks vs the whole-sequence recurrence")


def test_initial_state_enters_each_row_and_final_states_leave_them():
    """Two rows end to end, each given a state: the outputs of the recurrence started from that
    state in the row's first document (zero in its second), and the state after its last
    token."""
    gen = torch.Generator().manual_seed(9)
    heads, key_dim, value_dim = 4, 16, 8
    rows = [random_inputs(r, (30, 20), 2, heads, key_dim, value_dim, torch.float64) for r in (6, 7)]
    initial = torch.randn(2, heads, key_dim, value_dim, generator=gen, dtype=torch.float64)
    row_cu = torch.tensor([0, 30, 50, 80, 100], dtype=torch.int32)
    packed = {name: torch.cat([r[name] for r in rows], dim=1) for name in INPUT_NAMES}
    out, final = chunk_gated_delta_rule_torch_with_states(
        *[packed[name] for name in INPUT_NAMES], row_cu, initial
    )
    for r, row in enumerate(rows):
        expected, state = _recurrence_from(row, initial[r])
        torch.testing.assert_close(out[:, 50 * r : 50 * r + 50], expected)
        torch.testing.assert_close(final[r], state)


def _recurrence_from(inputs, state):
    """The token recurrence of `inputs` (documents of 30 and 20 tokens) with `state` entering
    the first document: outputs and the state after the last token."""
    q, k, v, g, beta = (inputs[name][0] for name in INPUT_NAMES)
    heads = v.shape[1]
    q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    q = q.repeat_interleave(heads // q.shape[1], dim=1) * q.shape[-1] ** -0.5
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    outputs = []
    for t in range(v.shape[0]):
        if t == 30:
            state = torch.zeros_like(state)
        state = state * g[t].exp()[:, None, None]
        correction = beta[t, :, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t, :, :, None] * correction[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outputs)[None], state


def test_affine_op_passes_opcheck():
    """The local pass is a custom op (one graph node when compiled): its fake shapes, schema
    and autograd registration agree with the kernel."""
    gen = torch.Generator().manual_seed(3)
    length, heads, dim = 40, 2, 8
    q, k = (torch.randn(1, length, heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(1, length, 2 * heads, 2 * dim, generator=gen)
    g = -torch.rand(1, length, 2 * heads, generator=gen)
    beta = torch.rand(1, length, 2 * heads, generator=gen)
    starts = torch.zeros(2, length // 2, dtype=torch.bool)
    starts[:, 0] = starts[0, 7] = True
    initial = torch.randn(2, 2 * heads, dim, 2 * dim, generator=gen)
    tensors = [t.requires_grad_() for t in (q, k, v, g, beta)]
    op = torch.ops.titan_gdn.affine_gated_delta_rule_torch
    torch.library.opcheck(op, (*tensors, padded_cu_seqlens(starts), initial, None))
