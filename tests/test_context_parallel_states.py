"""Context parallel over sequence chunks (state passing), alone and as heads x states, is exact:
the logits and every parameter gradient of cp = N equal those of one process (gloo): to 1e-6
in fp64, to 1e-5 in fp32 with FSDP. The split rule and its errors; compiled and checkpointed."""

import copy
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import NARROW_HEADS, perturbed_debug_model, relative_error
from tests.distributed import reference_and_rank_logits, run_on_ranks
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.model import qwen3_5_args
from titan_gdn.parallel.cp_layout import (
    apply_context_parallel_layout,
    choose_layout,
    layout_problems,
)
from titan_gdn.parallel.parallelize import parallelize_qwen3_5
from titan_gdn.validation import configuration_problems

EOS = 0
SEQ_LEN = 192
# The models: the debug model's head counts (4 key / 8 value GDN heads, 4 attention heads over
# 2 KV heads: cp = 8 cannot split them) on narrow heads (NARROW_HEADS).


def _global_batch(rows: int) -> torch.Tensor:
    """Packed rows whose documents cross chunk boundaries (24, 48, ... tokens at cp = 8),
    start exactly on one (96, and the 1-token document at 72), start within the conv's reach
    of one (47: the halo of the chunk at 48 is part of it), or hold a single token."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, 2048, (rows, SEQ_LEN + 1), generator=gen)
    # A document ends after its EOS: starts at 1, 2, 31, 47, 72, 73, 96, 101, 102, 103, 151.
    tokens[0, [0, 1, 30, 46, 71, 72, 95, 100, 101, 102, 150]] = EOS
    for row in range(1, rows):
        tokens[row, torch.randint(0, SEQ_LEN, (4,), generator=gen)] = EOS
    return tokens


def _job_config(mode: str, heads_degree: int) -> JobConfig:
    job = JobConfig()
    job.activation_checkpoint.mode = "none"
    job.training.mixed_precision_param = "float32"
    # titan_gdn's settings (titan_gdn/job_config.py), read with their defaults when absent.
    job.parallelism.context_parallel_mode = mode
    job.parallelism.context_parallel_heads_degree = heads_degree
    return job


def _check_matches_single_process(rank, world_size, dp_shard, cp, mode, heads_degree):
    """Without data parallel: in fp64, the cp layout alone (each rank's gradients summed over
    the cp ranks, as FSDP's reduction would), to 1e-6 for every parameter (the norms and the
    torch conv round to fp32 inside, which leaves about 1e-7). With dp_shard > 1: in fp32
    through FSDP, to 1e-5 (see the per-head scalars below)."""
    exact = dp_shard == 1
    reference = perturbed_debug_model(**NARROW_HEADS)
    reference = reference.double() if exact else reference
    model = copy.deepcopy(reference)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    dims.build_mesh()
    cp_mesh = dims.get_mesh("cp")
    if exact:
        layout = choose_layout(model.model_args, cp, mode, heads_degree)
        apply_context_parallel_layout(model, cp_mesh, layout)
    else:
        model = parallelize_qwen3_5(model, dims, _job_config(mode, heads_degree))

    ref_logits, logits = reference_and_rank_logits(
        reference, model, _global_batch(rows=2 * dp_shard), dims, EOS
    )

    tolerance = 1e-6 if exact else 1e-5
    assert relative_error(logits, ref_logits) <= tolerance
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if exact:
            grad = param.grad.clone()
            dist.all_reduce(grad, group=cp_mesh.get_group())
        else:
            grad = param.grad.full_tensor()
        error = relative_error(grad, expected[name].grad)
        # In fp32 the gradient of a per-head scalar (A_log, dt_bias) sums every token's terms,
        # which cancel: the single-process reference is itself about 2e-5 from fp64 there
        # (tests/test_context_parallel.py measures it).
        scalar = name.endswith(("A_log", "dt_bias"))
        assert error <= (5e-5 if scalar and not exact else tolerance), f"{name}: {error:.2e}"


@pytest.mark.parametrize(
    ("dp_shard", "cp", "heads_degree"),
    [(1, 2, 1), (1, 4, 1), (1, 8, 1), (1, 4, 2), (1, 8, 2), (2, 4, 2)],
    ids=["states2", "states4", "states8", "heads2xstates2", "heads2xstates4", "fsdp2xheads2x2"],
)
def test_state_passing_equals_single_process(dp_shard, cp, heads_degree):
    run_on_ranks(dp_shard * cp, _check_matches_single_process, dp_shard, cp, "states", heads_degree)


def _count_chunk_boundaries(rank, world_size):
    """Every derivation of fixed-capacity cu_seqlens in titan_gdn during one forward, counted."""
    model = perturbed_debug_model(**NARROW_HEADS)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=world_size, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    dims.build_mesh()
    layout = choose_layout(model.model_args, world_size, "states")
    apply_context_parallel_layout(model, dims.get_mesh("cp"), layout)
    inputs = _global_batch(rows=2)[:, :-1]
    docs = DocumentBoundaries.from_tokens(inputs, EOS)
    calls = []

    def counted(derive):
        def wrapper(*args, **kwargs):
            calls.append(derive)
            return derive(*args, **kwargs)

        return wrapper

    for name, module in list(sys.modules.items()):
        if name.startswith("titan_gdn") and hasattr(module, "padded_cu_seqlens"):
            module.padded_cu_seqlens = counted(module.padded_cu_seqlens)
    chunk = SEQ_LEN // world_size
    model(inputs[:, rank * chunk : (rank + 1) * chunk], attention_masks=docs)
    gdn_layers = model.model_args.layer_types.count("linear_attention")
    assert gdn_layers > 1
    # The chunk's boundaries and the conv's (over halo and chunk): once per forward, not per layer.
    assert len(calls) == 2, f"{len(calls)} derivations for {gdn_layers} GDN layers"


def test_a_chunks_boundaries_are_built_once_per_forward():
    run_on_ranks(2, _count_chunk_boundaries)


def test_auto_picks_heads_within_a_node_and_states_beyond():
    args = qwen3_5_args["debugmodel"]  # 4 key / 8 value heads, 4 attention heads, 2 KV heads
    assert (choose_layout(args, 4, "auto", 0, 8).heads, choose_layout(args, 4).states) == (4, 1)
    eight = choose_layout(args, 8, "auto", 0, gpus_per_node=8)
    assert (eight.heads, eight.states) == (4, 2)
    assert "head counts do not split" in eight.reason
    across_nodes = choose_layout(args, 4, "auto", 0, gpus_per_node=2)
    assert (across_nodes.heads, across_nodes.states) == (2, 2)
    assert "more than one node of 2 GPUs" in across_nodes.reason
    assert (choose_layout(args, 3).heads, choose_layout(args, 3).states) == (1, 3)
    two_b = choose_layout(qwen3_5_args["2B"], 16, "auto", 0, gpus_per_node=8)
    assert (two_b.heads, two_b.states) == (8, 2)  # 8 attention heads: 8 head groups per node
    assert choose_layout(args, 8, "states", 2).heads == 2
    assert choose_layout(args, 8, "states").heads == 1


def test_impossible_splits_name_the_settings_and_a_fix():
    args = qwen3_5_args["debugmodel"]
    assert layout_problems(args, 8, "auto", 0, 128) == []
    assert layout_problems(args, 8, "states", 0, 128) == []
    heads = " ".join(layout_problems(args, 8, "heads", 0, 128))
    assert "linear_num_key_heads = 4" in heads and "context_parallel_mode" in heads
    assert "'states' or 'auto'" in heads
    assert "is not one of" in " ".join(layout_problems(args, 2, "sequence", 0, 128))
    assert "does not divide" in " ".join(layout_problems(args, 8, "states", 3, 128))
    conflict = " ".join(layout_problems(args, 8, "heads", 2, 128))
    assert "context_parallel_heads_degree = 2" in conflict and "'states'" in conflict
    short = " ".join(layout_problems(args, 8, "states", 0, 16))
    assert "training.seq_len = 16" in short and "fewer than the conv needs" in short

    job = _job_config("heads", 0)
    job.parallelism.context_parallel_degree = 8
    job.training.seq_len = 128
    assert "linear_num_key_heads = 4" in " ".join(configuration_problems(job, world_size=8))
    job.parallelism.context_parallel_mode = "auto"  # heads 4 x states 2: nothing to report
    assert "context_parallel" not in " ".join(configuration_problems(job, world_size=8))


def _check_compiled_and_checkpointed(rank, world_size):
    from tests.test_compile import DOCUMENTS_PER_ROW, _batch
    from tests.test_compile import _job_config as compiled_job
    from tests.test_compile import _model as compile_model

    shard = slice(rank * 32 // world_size, (rank + 1) * 32 // world_size)
    reference = compile_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = [_batch(step) for step in range(len(DOCUMENTS_PER_ROW))]
    expected = []
    for batch in batches:  # eager, one process: logits and gradients of every step
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = reference(inputs, attention_masks=DocumentBoundaries.from_tokens(inputs, EOS))
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").div(
            labels.numel()
        ).backward()
        expected.append((logits, {n: p.grad.clone() for n, p in reference.named_parameters()}))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=world_size, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    dims.build_mesh()
    for ac in ("none", "full", "selective"):
        torch._dynamo.reset()
        counters.clear()
        job = compiled_job()
        job.parallelism.context_parallel_mode = "states"
        job.activation_checkpoint.mode = ac
        job.activation_checkpoint.selective_ac_option = "op"
        model = parallelize_qwen3_5(compile_model(), dims, job)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, batch in enumerate(batches):
            inputs, labels = batch[:, :-1], batch[:, 1:]
            docs = DocumentBoundaries.from_tokens(inputs, EOS)
            with torch._dynamo.config.patch(error_on_recompile=step > 0):
                logits = model(inputs[:, shard], attention_masks=docs)
                loss = F.cross_entropy(
                    logits.flatten(0, 1), labels[:, shard].flatten(), reduction="sum"
                )
                (loss / labels.numel()).backward()
            ref_logits, ref_grads = expected[step]
            assert relative_error(logits, ref_logits[:, shard]) <= 1e-5, (ac, step)
            for name, param in model.named_parameters():
                plain = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
                error = relative_error(param.grad.full_tensor(), ref_grads[plain])
                assert error <= 1e-5, f"{ac}, step {step}, {name}: {error:.2e}"
            optimizer.step()
            optimizer.zero_grad()
        assert not counters["graph_break"], ac
        assert counters["stats"]["unique_graphs"] == 2, ac  # one per layer type, at step 0


def test_state_passing_compiles_once_and_checkpoints_exactly():
    """Compiled blocks (fullgraph) with every checkpointing mode, over three steps whose
    document counts differ: no recompile, the eager single-process logits and gradients."""
    run_on_ranks(2, _check_compiled_and_checkpointed)
