"""Expert parallel (composed with FSDP and with context parallel) against one process, on gloo:
outputs, the loss with its load-balancing term, and every gradient."""

import copy

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import perturbed_debug_model, relative_error
from tests.distributed import rank_rows_and_tokens, run_on_ranks
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.loss import qwen3_5_loss
from titan_gdn.model import Qwen35Model, qwen3_5_args
from titan_gdn.parallel.expert_parallel import expert_parallel_problems
from titan_gdn.parallel.parallelize import parallelize_qwen3_5
from titan_gdn.validation import configuration_problems

EOS = 0
SEQ_LEN = 96


def _moe_model() -> Qwen35Model:
    return perturbed_debug_model("debugmoe")


def _batch(rows: int):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 2048, (rows, SEQ_LEN + 1), generator=gen)
    tokens[:, torch.randint(0, SEQ_LEN, (4,), generator=gen)] = EOS
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, -20:] = IGNORE_INDEX  # not real tokens: out of the CE and the aux loss
    return inputs, labels


def _job_config() -> JobConfig:
    job = JobConfig()
    job.activation_checkpoint.mode = "none"
    job.training.mixed_precision_param = "float32"
    return job


def _check_matches_single_process(rank, world_size, dp_shard, cp, ep):
    reference = _moe_model()
    model = copy.deepcopy(reference)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, pp=1, ep=ep, etp=1, world_size=world_size
    )
    dims.build_mesh()
    model = parallelize_qwen3_5(model, dims, _job_config())
    experts = model.layers["0"].mlp.experts.gate_up_proj
    assert "ep" in experts.device_mesh.mesh_dim_names  # sharded by expert, tokens dispatched
    assert experts.to_local().shape[0] <= 8 // ep

    inputs, labels = _batch(rows=2 * dp_shard)
    real_tokens = (labels != IGNORE_INDEX).sum()
    ref_pred = reference(
        inputs, attention_masks=DocumentBoundaries.from_tokens(inputs, EOS), chunked_loss=True
    )
    (qwen3_5_loss(ref_pred, labels) / real_tokens).backward()

    rows, tokens = rank_rows_and_tokens(dims, SEQ_LEN)
    docs = DocumentBoundaries.from_tokens(inputs[rows], EOS)
    pred = model(inputs[rows, tokens], attention_masks=docs, chunked_loss=True)
    group = dims.get_mesh("loss").get_group()
    loss = qwen3_5_loss(pred, labels[rows, tokens], group=group) / real_tokens
    loss.backward()

    ref_hidden = ref_pred.output.hidden[rows, tokens]
    assert relative_error(pred.output.hidden, ref_hidden) <= 1e-5
    local_tokens = ref_hidden.shape[0] * ref_hidden.shape[1]
    for ours, theirs in zip(pred.router_probs, ref_pred.router_probs, strict=True):
        theirs = theirs.view(-1, SEQ_LEN, theirs.shape[-1])[rows, tokens].flatten(0, 1)
        assert ours.shape[0] == local_tokens and relative_error(ours, theirs) <= 1e-5
    total = torch.tensor([loss.item()])
    torch.distributed.all_reduce(total)
    ref_loss = qwen3_5_loss(ref_pred, labels).item() / real_tokens.item()
    assert abs(total.item() - ref_loss) <= 1e-5 * ref_loss

    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        error = relative_error(param.grad.full_tensor(), expected[name].grad)
        assert error <= 1e-5, f"{name}: {error:.2e}"


@pytest.mark.parametrize(
    "dp_shard, cp, ep",
    [
        (2, 1, 2),  # ep = 2 over the data-parallel ranks
        (1, 2, 2),  # ep = 2 over the context-parallel ranks
        (4, 1, 2),  # dp_shard = 4: experts split 2 ways by ep and 2 ways by FSDP
    ],
)
def test_expert_parallel_equals_single_process(dp_shard, cp, ep):
    run_on_ranks(dp_shard * cp, _check_matches_single_process, dp_shard, cp, ep)


def test_bad_layouts_name_the_settings():
    moe, dense = qwen3_5_args["debugmoe"], qwen3_5_args["debugmodel"]  # 8 experts
    assert expert_parallel_problems(moe, 2, 2) == expert_parallel_problems(moe, 8, 8) == []
    assert "num_experts = 8" in " ".join(expert_parallel_problems(moe, 3, 3))
    assert "context_parallel_degree = 2" in " ".join(expert_parallel_problems(moe, 4, 2))
    assert "has no experts" in " ".join(expert_parallel_problems(dense, 2, 2))

    job = _job_config()
    job.model.flavor = "debugmoe"
    job.model.hf_assets_path = "./assets/tokenizer"
    job.parallelism.expert_parallel_degree = 4
    job.parallelism.context_parallel_degree = 2  # world 2: dp_shard 1 x cp 2 holds no 4 ranks
    problems = " ".join(configuration_problems(job, world_size=2))
    assert "expert_parallel_degree = 4 does not divide data_parallel_shard_degree" in problems
    job.parallelism.expert_parallel_degree = 3
    problems = " ".join(configuration_problems(job, world_size=6))
    assert "expert_parallel_degree = 3 does not divide the model's num_experts = 8" in problems
    assert "expert_parallel_degree = 3 is not supported" not in problems
