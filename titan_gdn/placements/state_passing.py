"""Where a mixer's sequence lives: the whole row on this rank, or a contiguous chunk of it on
each rank of the `states` dimension of the cp mesh, with the state carried between chunks.

Head sharding (`HeadSharding`) moves every token's q, k, v and gates across the group twice per
layer and needs the head counts divisible by its degree. Over the `states` dimension the tokens
stay where they are and the mixers exchange only what crosses a chunk boundary, independent of
the sequence length:

- the short conv: the K - 1 tokens before the chunk (zero where a document starts between them
  and the chunk), from the previous rank;
- the delta rule: each rank runs it on its chunk; the state entering the chunk comes from the
  ranks before it, through the document the chunk starts in (none where a document starts at
  the chunk's first token): one all-gather of a [Dk, Dv + Dk] summary per value head and row
  (`titan_gdn.ops.delta_rule.state_passing`; on CUDA FLA's `fla.ops.cp`);
- attention: an all-gather of K and V (2 to 4 KV heads in Qwen3.5, so small next to Q), each
  rank's queries against the keys up to its chunk's end under the global document mask.

Document boundaries stay global (`DocumentBoundaries` of the whole row), with the chunk's own
(`ChunkBoundaries`, where a document cut by the chunk start begins at the chunk's first token)
built once per step by `boundaries` and read by every layer. Gradients flow back through each
exchange (the collectives' backward is their adjoint). Without context parallel over states there
is one chunk and every method is the plain op.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_gdn.boundaries import ChunkBoundaries, DocumentBoundaries
from titan_gdn.ops.attention import document_causal_attention
from titan_gdn.ops.conv import causal_conv1d_silu
from titan_gdn.ops.delta_rule import gated_delta_rule, resolve_delta_rule_backend
from titan_gdn.placements.collectives import all_gather, from_previous_rank


class StatePassing:
    def __init__(self, mesh: DeviceMesh | None = None):
        self.mesh = mesh
        self.degree = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else mesh.get_local_rank()
        self.group_name = None if mesh is None else mesh.get_group().group_name

    def chunk(self, seq_len: int) -> tuple[int, int]:
        """This rank's tokens [start, end) of every row of `seq_len` tokens."""
        size = seq_len // self.degree
        return self.rank * size, (self.rank + 1) * size

    def queries(self, seq_len: int) -> tuple[int, int] | None:
        """The queries this rank's attention runs, as flex's block mask takes them: its chunk
        of rows of `seq_len` tokens; None (the whole rows) without chunks."""
        return None if self.mesh is None else self.chunk(seq_len)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a [B, T, ...] tensor of the whole row (RoPE's cos and sin)."""
        if self.mesh is None:
            return x
        start, end = self.chunk(x.shape[1])
        return x[:, start:end]

    def boundaries(self, docs: DocumentBoundaries, halo: int) -> DocumentBoundaries:
        """The whole rows' boundaries with this rank's chunk's (`docs.chunk`, the conv reading
        `halo` tokens before it): what every layer of the step reads. Without context parallel
        over states, `docs` as they are."""
        if self.mesh is None:
            return docs
        return docs.for_chunk(*self.chunk(docs.document_ids.shape[1]), halo)

    def causal_conv1d_silu(self, x, weight, docs: DocumentBoundaries, backend):
        """The GDN conv of x [1, B * Tc, C] (this rank's chunk of every row, end to end).

        FLA's conv takes a cp_context too (`fla.modules.causal_conv1d`), for its own kernels and
        backward only; the halo in front of the chunk keeps whichever backend is picked
        (causal_conv1d, or FLA's forward with our one-kernel backward) and costs K - 1 tokens.
        """
        if self.mesh is None:
            return causal_conv1d_silu(x, weight, docs.padded_cu_seqlens, backend)
        chunk = _chunk(docs)
        halo = weight.shape[1] - 1
        if chunk.halo != halo:
            raise ValueError(
                f"the chunk's boundaries were built for a conv halo of {chunk.halo} tokens, "
                f"the conv weight reads {halo}: build them with linear_conv_kernel_dim - 1"
            )
        rows = x.view(docs.document_ids.shape[0], chunk.end - chunk.start, -1)
        if halo:
            # The previous chunk's last K - 1 tokens, zero where they are of another document
            # than this chunk's first token (and on the first rank, which has none).
            before = from_previous_rank(rows[:, -halo:], self.group_name, 1)
            same = chunk.halo_in_document[..., None].to(before.dtype)
            rows = torch.cat([before * same, rows], dim=1)
        out = causal_conv1d_silu(
            rows.reshape(1, -1, rows.shape[-1]), weight, chunk.conv_cu_seqlens, backend
        )
        return out.view(rows.shape[0], -1, out.shape[-1])[:, halo:].reshape(x.shape)

    def gated_delta_rule(self, q, k, v, g, beta, docs: DocumentBoundaries, backend):
        """The gated delta rule of this rank's chunk of every row ([1, B * Tc, ...] inputs), the
        state carried in from the chunks before it."""
        if self.mesh is None:
            return gated_delta_rule(q, k, v, g, beta, docs.padded_cu_seqlens, backend=backend)
        chunk = _chunk(docs)
        # FlashQLA takes no carried-in state of this layout: its rows run on FLA's kernels.
        if resolve_delta_rule_backend(q.device, backend) in ("fla", "flash_qla"):
            from titan_gdn.ops.delta_rule.fla_cp_op import fla_gated_delta_rule_cp

            return fla_gated_delta_rule_cp(q, k, v, g, beta, chunk, self.group_name)
        from titan_gdn.ops.delta_rule import state_passing

        batch = docs.document_ids.shape[0]
        outputs, summary = state_passing.affine_gated_delta_rule(
            q, k, v, g, beta, chunk.padded_cu_seqlens, batch, None
        )
        summaries = all_gather(summary, self.group_name)
        state = state_passing.incoming_states(summaries, chunk.continues, self.rank)
        return state_passing.add_incoming_state(outputs, state)

    def attention(self, q, k, v, docs: DocumentBoundaries, backend):
        """Document-causal attention of this rank's queries q [B, H, Tc, D] over the keys and
        values k, v [B, Hkv, Tc, D] of every chunk up to this one."""
        if self.mesh is None:
            return document_causal_attention(
                q,
                k,
                v,
                docs.document_ids,
                docs.block_mask,
                backend,
                cu_seqlens=docs.padded_cu_seqlens,
            )
        start = _chunk(docs).start
        # Only the chunks up to this one hold keys a query here may see.
        k, v = (all_gather(t, self.group_name)[: self.rank + 1] for t in (k, v))
        k, v = (t.movedim(0, 2).flatten(2, 3) for t in (k, v))
        # The model's forward hands flex the mask of this chunk's queries.
        return document_causal_attention(
            q, k, v, docs.document_ids, docs.block_mask, backend, start, docs.padded_cu_seqlens
        )


def _chunk(docs: DocumentBoundaries) -> ChunkBoundaries:
    if docs.chunk is None:
        raise ValueError(
            "context parallel over sequence chunks reads the chunk's boundaries (docs.chunk): "
            "pass the model the whole rows' DocumentBoundaries, its forward builds the chunk's "
            "once for every layer (StatePassing.boundaries)"
        )
    return docs.chunk


NO_STATE_PASSING = StatePassing()
