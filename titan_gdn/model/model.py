"""The Qwen3.5 hybrid text model: 3 Gated DeltaNet blocks to 1 gated-attention block."""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.layers.attention import GatedAttention
from titan_gdn.layers.gated_deltanet import GatedDeltaNet
from titan_gdn.layers.mlp import FeedForward
from titan_gdn.layers.moe import SparseMoeBlock
from titan_gdn.layers.norms import ZeroCenteredRMSNorm
from titan_gdn.layers.rope import rope_cos_sin
from titan_gdn.loss import OutputHidden, RoutedOutput
from titan_gdn.model.args import LINEAR_ATTENTION, Qwen35ModelArgs
from titan_gdn.ops.attention import (
    block_mask_in_place,
    document_causal_block_mask,
    resolve_attn_backend,
)
from titan_gdn.placements.state_passing import NO_STATE_PASSING, StatePassing


class DecoderBlock(nn.Module):
    """A mixer and an MLP, each behind a pre-norm residual. With `moe`, the MLP is the sparse MoE
    block and the block returns (hidden, router probabilities, experts) for the aux loss."""

    def __init__(self, args: Qwen35ModelArgs, layer_type: str, moe: bool = False):
        super().__init__()
        self.layer_type = layer_type
        self.moe = moe
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = SparseMoeBlock(args) if moe else FeedForward(args.dim, args.hidden_dim)
        self.input_layernorm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn

    def forward(self, x: torch.Tensor, docs: DocumentBoundaries, rope) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            h = self.linear_attn(h, docs)
        else:
            h = self.self_attn(h, docs, rope)
        x = x + h
        if self.moe:
            h, probs, experts = self.mlp(self.post_attention_layernorm(x))
            return x + h, probs, experts
        return x + self.mlp(self.post_attention_layernorm(x))

    def init_weights(self, std: float) -> None:
        self.mixer.init_weights(std)
        if self.moe:
            self.mlp.init_weights(std)
        else:
            for linear in (self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj):
                nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.input_layernorm.reset_parameters()
        self.post_attention_layernorm.reset_parameters()


class Qwen35Model(ModelProtocol):
    """torchtitan model: `forward(tokens, attention_masks=DocumentBoundaries) -> logits`;
    with `chunked_loss=True` (the trainer's call) it may return `OutputHidden` for the loss.

    Attribute names follow torchtitan's llama3/qwen3 (tok_embeddings, layers, norm, output) so
    torchtitan's parallelism helpers apply; block internals follow transformers' Qwen3.5.
    """

    def __init__(self, model_args: Qwen35ModelArgs):
        super().__init__(model_args)
        self.model_args = model_args
        # Where the attention masks keep their tensors from batch to batch, for compiled blocks
        # replayed as CUDA graphs (set by parallelize with compile.cudagraphs); None: new ones.
        self.block_mask_storage: dict | None = None
        # Where every mixer's sequence lives (set by parallelize with context parallel over
        # sequence chunks): the forward builds the chunk's boundaries from it once for every
        # layer, and the batch preparation builds the attention mask for the chunk's queries.
        self.state_passing: StatePassing = NO_STATE_PASSING
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderBlock(model_args, t, moe=model_args.is_moe_layer(i))
                for i, t in enumerate(model_args.layer_types)
            }
        )
        self.norm = ZeroCenteredRMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        if self.model_args.enable_weight_tying:
            # torchtitan builds on the meta device and materializes with to_empty, which gives
            # each module a new Parameter and so unties them; tie again (as torchtitan's qwen3).
            self.output.weight = self.tok_embeddings.weight
        std = self.model_args.initializer_range
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            layer.init_weights(std)
        self.norm.reset_parameters()
        if not self.model_args.enable_weight_tying:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def get_attention_masks(
        self, input_batch, tokenizer, extra_inputs=None, queries: tuple[int, int] | None = None
    ) -> DocumentBoundaries:
        """The boundaries of the whole rows; with flex attention, the block mask of the queries
        at positions `queries` = (start, end) of each row (default: all of them)."""
        docs = DocumentBoundaries.from_tokens(input_batch, tokenizer.eos_id)
        return self._with_flex_mask(docs, queries)

    def _with_flex_mask(
        self, docs: DocumentBoundaries, queries: tuple[int, int] | None
    ) -> DocumentBoundaries:
        """`docs` with flex attention's block mask of the queries `queries` (None: the whole
        rows) where flex runs and the mask that came with them is not that one (none, or the
        whole rows' for a chunk's queries). Built here, outside the compiled blocks, as the
        trainer's masks are: flex with its mask built inside a compiled block gave wrong logits
        under compiled selective checkpointing (fp32 debug model, H200; relative error 0.2)."""
        if resolve_attn_backend(docs.document_ids.device, self.model_args.attn_backend) != "flex":
            return docs
        start, end = queries or (0, docs.document_ids.shape[1])
        if docs.block_mask is not None and docs.block_mask.seq_lengths == (end - start, end):
            return docs
        block_mask = document_causal_block_mask(docs.document_ids, queries)
        if self.block_mask_storage is not None:
            block_mask = block_mask_in_place(block_mask, self.block_mask_storage)
        return docs.with_block_mask(block_mask)

    def forward(
        self,
        tokens: torch.Tensor,
        attention_masks: DocumentBoundaries | None = None,
        *,
        chunked_loss: bool = False,
        **unused,
    ) -> torch.Tensor | OutputHidden:
        """Logits [B, T, vocab]. Without `attention_masks` each row is one document.

        With `chunked_loss` and `loss_chunk_tokens` resolving to > 0: `OutputHidden`, for
        titan_gdn.loss to project and score a chunk of tokens at a time. With `chunked_loss`
        (the trainer's call) and a load-balancing loss (`router_aux_loss_coef` > 0), that output
        inside a `RoutedOutput` with every MoE layer's routing.
        """
        docs = attention_masks
        if docs is None:
            docs = DocumentBoundaries.whole_rows(*tokens.shape, device=tokens.device)
        docs = self._with_flex_mask(docs, self.state_passing.queries(docs.document_ids.shape[1]))
        args = self.model_args
        docs = self.state_passing.boundaries(docs, halo=args.linear_conv_kernel_dim - 1)
        h = _in_autocast_dtype(self.tok_embeddings(tokens))
        rope = rope_cos_sin(docs.position_ids, args.rotary_dim, args.rope_theta, h.dtype)
        probs, experts = [], []
        for layer in self.layers.values():
            h = layer(h, docs, rope)
            if isinstance(h, tuple):  # an MoE block: its routing, for the aux loss
                h, layer_probs, layer_experts = h
                probs.append(layer_probs)
                experts.append(layer_experts)
        output = self._output(self.norm(h), chunked_loss)
        if chunked_loss and probs and args.router_aux_loss_coef > 0:
            return RoutedOutput(output, probs, experts, args.router_aux_loss_coef)
        return output

    def _output(self, h: torch.Tensor, chunked_loss: bool) -> torch.Tensor | OutputHidden:
        chunk_tokens = self.model_args.chunked_loss_tokens
        if chunked_loss and chunk_tokens > 0:
            # The output module, not its weight: under FSDP2 `self.output.weight` is swapped
            # between sharded and unsharded parameters, and the loss must see the live one.
            return OutputHidden(h, self.output, chunk_tokens)
        return self.output(h)


def _in_autocast_dtype(h: torch.Tensor) -> torch.Tensor:
    """The residual stream in autocast's dtype where autocast is on (one GPU: fp32 parameters).

    Under FSDP's policy the embeddings come out in bf16 and so does every block's residual;
    autocast alone would carry it in fp32, so one GPU would train with other numerics than
    FSDP, and full checkpointing would save every block's input at twice the size (36 GiB more
    at 786k tokens for 0.8B: the difference between fitting on one H200 and not).
    """
    device = h.device.type
    return h.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else h
