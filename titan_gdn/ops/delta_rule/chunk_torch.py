"""Chunked gated delta rule in plain torch (WY / UT transform), differentiable by autograd.

Within a chunk of C tokens with cumulative log-decay gamma_i (from the chunk start) and
carried-in state S, every token's state update is written through "new values" u_i:

    (I + A) U = diag(beta) V - diag(beta * exp(gamma)) K S
    O         = diag(exp(gamma)) Q S + (Q K^T * exp(gamma_i - gamma_j))_{j<=i} U
    S'        = exp(gamma_C) S + (K * exp(gamma_C - gamma))^T U

with A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j for j < i, 0 otherwise. The triangular solve
is done once for all chunks; only the three products with S run in the sequential scan.

Packed documents never share a chunk: each is padded to a multiple of C in a scratch layout,
and the carried state is zeroed at chunks where a document starts. Padding tokens have
k = v = 0, beta = 0 and g = 0, so they write nothing and decay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_gdn.boundaries import token_documents
from titan_gdn.ops.delta_rule.inputs import per_value_head


def chunk_gated_delta_rule_torch(
    q, k, v, g, beta, cu_seqlens, scale: float | None = None, chunk_size: int = 64
) -> torch.Tensor:
    """Gated delta rule over packed documents; returns o [1, T, Hv, Dv] in v's dtype.

    Same contract as :func:`titan_gdn.ops.delta_rule.gated_delta_rule`. Computes in fp32, or in
    fp64 when given fp64 inputs.
    """
    return chunk_gated_delta_rule_torch_with_states(
        q, k, v, g, beta, cu_seqlens, None, scale, chunk_size
    )[0]


def chunk_gated_delta_rule_torch_with_states(
    q, k, v, g, beta, cu_seqlens, initial_state, scale: float | None = None, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same over R rows of T / R tokens laid end to end, each row continuing a document
    that began before it: (o, final_state).

    `initial_state` [R, Hv, Dk, Dv] (None: zeros, R = 1) enters the first document of each
    row, which must start a document in `cu_seqlens`; `final_state` [R, Hv, Dk, Dv] (fp32, or
    fp64) is the state after each row's last token. Documents inside a row start from zero.
    """
    layout = DocumentChunkLayout.build(cu_seqlens, v.shape[1], chunk_size)
    inputs = per_value_head(q, k, v, g, beta, scale)
    _, value_heads, key_dim = inputs[1].shape
    dtype = inputs[2].dtype
    if initial_state is None:
        initial_state = inputs[2].new_zeros(1, value_heads, key_dim, v.shape[3])
    chunks = [layout.to_chunks(x) for x in inputs]
    rows = layout.row_chunks(initial_state.shape[0])
    out, final_state = _scan_chunks(
        _intra_chunk_terms(*chunks), layout.carry.to(dtype), initial_state.to(dtype), rows
    )
    return layout.from_chunks(out)[None].to(v.dtype), final_state


@dataclass(frozen=True)
class DocumentChunkLayout:
    """Where each packed token sits once every document is padded to whole chunks."""

    position: torch.Tensor  # [T] index of each token in the padded layout
    carry: torch.Tensor  # [num_chunks] 0 where a document starts, else 1
    num_chunks: int
    chunk_size: int

    @classmethod
    def build(
        cls, cu_seqlens: torch.Tensor, num_tokens: int, chunk_size: int
    ) -> DocumentChunkLayout:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
        bounds = cu_seqlens.long()
        lengths = bounds[1:] - bounds[:-1]
        padded_starts = F.pad((-(-lengths // chunk_size) * chunk_size).cumsum(0), (1, 0))
        first, last, padded_total = torch.stack([bounds[0], bounds[-1], padded_starts[-1]]).tolist()
        if first != 0 or last != num_tokens:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={num_tokens}: {cu_seqlens}")
        document = token_documents(bounds, num_tokens)
        token = torch.arange(num_tokens, device=bounds.device)
        position = padded_starts[document] + token - bounds[document]
        num_chunks = padded_total // chunk_size
        # Empty trailing documents start at chunk `num_chunks`: the spare slot absorbs them.
        carry = torch.ones(num_chunks + 1, device=bounds.device)
        carry = carry.index_fill(0, padded_starts[:-1] // chunk_size, 0.0)[:num_chunks]
        return cls(position, carry, num_chunks, chunk_size)

    def row_chunks(self, rows: int) -> tuple[list[int], list[int]]:
        """The chunk where each of `rows` equal rows starts, and the one holding its last
        token (a host sync; the scan runs on the host anyway)."""
        num_tokens = self.position.shape[0]
        if num_tokens % rows:
            raise ValueError(f"{rows} rows do not split {num_tokens} tokens evenly")
        row_len = num_tokens // rows
        starts = self.position[::row_len] // self.chunk_size
        if not bool((self.carry[starts] == 0).all()):
            raise ValueError("every row must start a document in cu_seqlens")
        ends = self.position[row_len - 1 :: row_len] // self.chunk_size
        return starts.tolist(), ends.tolist()

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] -> [H, num_chunks, chunk_size, ...], zeros in the padding."""
        padded = x.new_zeros(self.num_chunks * self.chunk_size, *x.shape[1:])
        padded = padded.index_copy(0, self.position, x)
        return padded.unflatten(0, (self.num_chunks, self.chunk_size)).movedim(2, 0)

    def from_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[H, num_chunks, chunk_size, D] -> [T, H, D], dropping the padding."""
        return x.movedim(0, 2).flatten(0, 1).index_select(0, self.position)


def _intra_chunk_terms(q, k, v, g, beta):
    """Everything that does not depend on the carried state, for all chunks at once."""
    # Differences of cumulative log-decays cancel: under strong decay the sums reach -1e3 in a
    # chunk, where fp32 keeps only ~1e-4 absolute, so the sums and differences are fp64.
    log_decay = g.to(torch.float64).cumsum(-1)
    chunk_size = g.shape[-1]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=g.device).tril()
    # Mask before exp: above the diagonal gamma_i - gamma_j > 0 and could overflow to inf.
    pair_log_decay = log_decay[..., :, None] - log_decay[..., None, :]
    pair_decay = pair_log_decay.masked_fill(~causal, -torch.inf).to(g.dtype).exp()
    decay_from_start = log_decay.to(g.dtype).exp()
    decay_to_end = (log_decay[..., -1:] - log_decay).to(g.dtype).exp()
    scores = (q @ k.mT) * pair_decay
    # unitriangular: the solve reads only the strict lower triangle and takes 1 on the diagonal.
    system = (k @ k.mT) * pair_decay * beta[..., None]
    rhs = torch.cat([k * (beta * decay_from_start)[..., None], v * beta[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    state_weights, new_values = solved.split([k.shape[-1], v.shape[-1]], dim=-1)
    return {
        "q_decayed": q * decay_from_start[..., None],
        "scores": scores,
        "state_weights": state_weights,
        "new_values": new_values,
        "k_to_chunk_end": k * decay_to_end[..., None],
        "chunk_decay": decay_from_start[..., -1:, None],
    }


def _scan_chunks(
    terms: dict[str, torch.Tensor],
    carry: torch.Tensor,
    initial_state: torch.Tensor,
    rows: tuple[list[int], list[int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    heads, _, _, key_dim = terms["k_to_chunk_end"].shape
    value_dim = terms["new_values"].shape[-1]
    state = terms["new_values"].new_zeros(heads, key_dim, value_dim)
    entering = {chunk: row for row, chunk in enumerate(rows[0])}
    leaving = {chunk: row for row, chunk in enumerate(rows[1])}
    final_states = [None] * len(rows[1])
    # unbind, not x[:, n]: autograd then stacks one gradient per term instead of adding a
    # full-size zero tensor per chunk, which made the backward quadratic in the chunk count.
    chunks = zip(carry.unbind(0), *(terms[name].unbind(1) for name in _SCAN_TERMS), strict=True)
    outputs = []
    for n, (keep, q_decayed, scores, state_weights, new_values, k_to_end, chunk_decay) in enumerate(
        chunks
    ):
        state = state * keep
        if n in entering:
            state = state + initial_state[entering[n]]
        new_values = new_values - state_weights @ state
        outputs.append(q_decayed @ state + scores @ new_values)
        state = state * chunk_decay + k_to_end.mT @ new_values
        if n in leaving:
            final_states[leaving[n]] = state
    return torch.stack(outputs, dim=1), torch.stack(final_states)


_SCAN_TERMS = (
    "q_decayed",
    "scores",
    "state_weights",
    "new_values",
    "k_to_chunk_end",
    "chunk_decay",
)
