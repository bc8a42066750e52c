"""Compiled blocks: fullgraph, no recompiles as document layouts change, and equal to eager.

Each training step packs a different number of documents; the blocks are compiled once (one
graph per layer type) and reused by every later step. The compiled model trains in lockstep
with an eager reference, whose outputs and gradients it matches to fp32 tolerance.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import relative_error
from tests.distributed import run_on_ranks
from titan_gdn.boundaries import DocumentBoundaries, documents_and_chunks
from titan_gdn.layers.rope import rope_cos_sin
from titan_gdn.model import Qwen35Model, qwen3_5_args
from titan_gdn.model.args import FULL_ATTENTION, LINEAR_ATTENTION
from titan_gdn.ops.conv import causal_conv1d_silu
from titan_gdn.ops.delta_rule import gated_delta_rule
from titan_gdn.parallel.parallelize import parallelize_qwen3_5

EOS = 0
ROWS, SEQ_LEN = 2, 32
DOCUMENTS_PER_ROW = (1, 3, 6)  # one step each: a new document count every step


def _model(flavor: str = "debugmodel") -> Qwen35Model:
    torch.manual_seed(0)
    model = Qwen35Model(copy.deepcopy(qwen3_5_args[flavor]))
    model.init_weights()
    return model


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, 2048, (ROWS, SEQ_LEN + 1), generator=gen)
    for row in range(ROWS):
        ends = torch.randperm(SEQ_LEN - 1, generator=gen)[: DOCUMENTS_PER_ROW[step] - 1]
        tokens[row, ends] = EOS
    return tokens


def _job_config() -> JobConfig:
    job = JobConfig()
    job.activation_checkpoint.mode = "none"
    job.training.mixed_precision_param = "float32"
    job.compile.enable = True
    job.compile.components = ["model"]
    job.compile.backend = "aot_eager"
    return job


def _step(model, optimizer, inputs, labels, docs, tokens=slice(None)):
    logits = model(inputs[:, tokens], attention_masks=docs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels[:, tokens].flatten(), reduction="sum")
    (loss / labels.numel()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    return logits, grads


def _train_and_compare(compiled, dims, tokens=slice(None), flavor="debugmodel", graphs=2):
    """Three steps of `compiled` and of an eager single-process copy, compared every step."""
    reference = _model(flavor)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (compiled, reference)]
    counters.clear()
    for step in range(len(DOCUMENTS_PER_ROW)):
        batch = _batch(step)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        docs = DocumentBoundaries.from_tokens(inputs, EOS)
        assert docs.num_documents == ROWS * DOCUMENTS_PER_ROW[step]
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            logits, grads = _step(compiled, optimizers[0], inputs, labels, docs, tokens)
        ref_logits, ref_grads = _step(reference, optimizers[1], inputs, labels, docs)
        assert relative_error(logits, ref_logits[:, tokens]) <= 1e-5
        for name, grad in grads.items():
            full = grad.full_tensor() if dims.fsdp_enabled else grad
            reference_name = name.replace("_orig_mod.", "")
            error = relative_error(full, ref_grads[reference_name])
            assert error <= 1e-5, f"step {step}, {name}: {error:.2e}"
    assert not counters["graph_break"]
    # One graph per compiled part and layer type, all made in the first step.
    assert counters["stats"]["unique_graphs"] == graphs


def _parallel_dims(cp: int) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=1, pp=1, ep=1, etp=1, world_size=cp)


def test_compiled_blocks_match_eager_without_recompiles():
    torch._dynamo.reset()
    dims = _parallel_dims(1)
    model = parallelize_qwen3_5(_model(), dims, _job_config())
    _train_and_compare(model, dims)


def test_compiled_moe_blocks_match_eager_without_recompiles():
    """An MoE block compiles part by part, the routed experts left eager (on CPU their loop
    reads the group ends on the host): the router, the dispatch into padded groups, the
    combine, the shared expert and its gate, besides the mixer and the norms."""
    torch._dynamo.reset()
    dims = _parallel_dims(1)
    model = parallelize_qwen3_5(_model("debugmoe"), dims, _job_config())
    # One graph per code compiled: the two mixers, the norm (both norms of every block), and
    # the MoE block's parts.
    moe_parts = ("gate", "dispatch", "combine", "shared_expert", "shared_expert_gate")
    _train_and_compare(model, dims, flavor="debugmoe", graphs=2 + 1 + len(moe_parts))


def _check_compiled_context_parallel(rank, world_size):
    dims = _parallel_dims(world_size)
    dims.build_mesh()
    model = parallelize_qwen3_5(_model(), dims, _job_config())
    cp_rank = dims.get_mesh("cp").get_local_rank()
    shard = SEQ_LEN // world_size
    _train_and_compare(model, dims, slice(cp_rank * shard, (cp_rank + 1) * shard))


def test_compiled_context_parallel_matches_eager_without_recompiles():
    run_on_ranks(2, _check_compiled_context_parallel)


@pytest.mark.parametrize("layer_type", [LINEAR_ATTENTION, FULL_ATTENTION])
def test_each_block_traces_as_one_graph(layer_type):
    torch._dynamo.reset()
    model = _model()
    block = next(b for b in model.layers.values() if b.layer_type == layer_type)
    docs = DocumentBoundaries.from_tokens(_batch(1)[:, :-1], EOS)
    args = model.model_args
    rope = rope_cos_sin(docs.position_ids, args.rotary_dim, args.rope_theta, torch.float32)
    x = torch.randn(ROWS, SEQ_LEN, args.dim)
    explanation = torch._dynamo.explain(block)(x, docs, rope)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(0)
    docs = DocumentBoundaries.from_tokens(_batch(2)[:1, :-1], EOS)
    length, heads, dim = SEQ_LEN, 2, 8
    q, k = (torch.randn(1, length, heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(1, length, 2 * heads, dim, generator=gen)
    g = -torch.rand(1, length, 2 * heads, generator=gen)
    beta = torch.rand(1, length, 2 * heads, generator=gen)
    x, weight = torch.randn(1, length, 6, generator=gen), torch.randn(6, 4, generator=gen)
    cases = [
        (torch.ops.titan_gdn.gated_delta_rule_torch, (q, k, v, g, beta), (None,)),
        (torch.ops.titan_gdn.causal_conv1d_silu, (x, weight), ("torch",)),
    ]
    for op, tensors, constants in cases:
        tensors = [t.requires_grad_() for t in tensors]
        torch.library.opcheck(op, (*tensors, docs.padded_cu_seqlens, *constants))
    # The padded boundaries give what the exact ones give, and trim back to them (for FLA).
    assert torch.equal(documents_and_chunks(docs.padded_cu_seqlens)[0], docs.cu_seqlens)
    assert torch.equal(
        gated_delta_rule(q, k, v, g, beta, docs.padded_cu_seqlens),
        gated_delta_rule(q, k, v, g, beta, docs.cu_seqlens),
    )
    assert torch.equal(
        causal_conv1d_silu(x, weight, docs.padded_cu_seqlens),
        causal_conv1d_silu(x, weight, docs.cu_seqlens),
    )
