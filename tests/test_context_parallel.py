"""Context parallel is exact: cp = N gives the outputs and gradients of cp = 1 (gloo).

Both sides run in fp64, so that the bound tests the layout, not the CPU's summation order.
In fp32, the gradient of a per-head scalar (A_log, dt_bias) is a sum over every token whose
terms cancel: one process's fp32 gradient is 3.3e-6 from its fp64 one (this debug model, 4
rows, measured), so two fp32 summation orders may differ by twice that, and a 1e-5 bound
would leave them a margin of 1.5. In fp64 what remains is the model's own fp32 work (norms,
the conv and the decay compute in fp32): the per-rank A_log and dt_bias gradients are
rounded to fp32 before FSDP sums them over the dp ranks, where they partly cancel. Measured:
logits equal, gradients within 1.8e-7 at dp_shard x cp = 1 x 2, 1 x 4 and 2 x 2, and 4.3e-7
at 2 x 4 (narrow heads); the bound is the fp32 one asked of CP, 1e-5. A dropped, doubled or
misplaced slice of heads or tokens moves a tensor by orders of magnitude more. fp32 CP
against cp = 1 at 1e-5, at cp = 2: test_compile and test_activation_checkpoint.
"""

import copy

import pytest
import torch
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import NARROW_HEADS, perturbed_debug_model, relative_error
from tests.distributed import reference_and_rank_logits, run_on_ranks
from titan_gdn.model import qwen3_5_args
from titan_gdn.model.job_checks import job_config_problems
from titan_gdn.parallel import parallelize
from titan_gdn.parallel.context_parallel import context_parallel_problems
from titan_gdn.parallel.parallelize import parallelize_qwen3_5
from titan_gdn.validation import configuration_problems

EOS = 0
SEQ_LEN = 192
BOUND = 1e-5  # fp64 both sides: see the module docstring


def _global_batch(rows: int) -> torch.Tensor:
    """Packed rows whose documents cross every shard boundary, with length-1 documents."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 2048, (rows, SEQ_LEN + 1), generator=gen)
    tokens[0, [0, 1, 30, 31, 100, 101, 102, 150]] = EOS  # 1-token documents, odd lengths
    tokens[1:, torch.randint(0, SEQ_LEN, (5,), generator=gen)] = EOS
    return tokens


def _job_config() -> JobConfig:
    job = JobConfig()
    job.activation_checkpoint.mode = "none"
    job.training.mixed_precision_param = "float32"
    return job


# Heads for CP degrees up to 8: 8 key / 16 value GDN heads, 8 attention heads over 2 KV heads
# (each KV head repeated to 4 ranks at cp=8), narrow so that 16 CPU processes stay affordable.
WIDE_HEADS = dict(
    NARROW_HEADS, linear_num_key_heads=8, linear_num_value_heads=16, n_heads=8, n_kv_heads=2
)


def _fp64_job_config() -> JobConfig:
    """FSDP computes and reduces in fp64. torchtitan names no dtype above float32, so this
    process's FSDP is given the name (the test runs in processes of its own)."""
    parallelize.TORCH_DTYPE_MAP = {**TORCH_DTYPE_MAP, "float64": torch.float64}
    job = _job_config()
    job.training.mixed_precision_param = job.training.mixed_precision_reduce = "float64"
    return job


def _check_cp_matches_single_process(rank, world_size, dp_shard, cp, heads=None):
    reference = perturbed_debug_model(**(heads or {})).double()
    model = copy.deepcopy(reference)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    dims.build_mesh()
    model = parallelize_qwen3_5(model, dims, _fp64_job_config())

    ref_logits, logits = reference_and_rank_logits(
        reference, model, _global_batch(rows=2 * dp_shard), dims, EOS
    )

    assert logits.dtype == torch.float64  # nothing on the way cast to fp32
    assert relative_error(logits, ref_logits) <= BOUND
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        reference_name = name.replace("_checkpoint_wrapped_module.", "")
        grad = param.grad.full_tensor()
        assert grad.dtype == torch.float64, name
        error = relative_error(grad, expected[reference_name].grad)
        assert error <= BOUND, f"{name}: {error:.2e}"


@pytest.mark.parametrize("dp_shard, cp", [(1, 2), (1, 4), (2, 2)])
def test_context_parallel_equals_single_process(dp_shard, cp):
    run_on_ranks(dp_shard * cp, _check_cp_matches_single_process, dp_shard, cp)


@pytest.mark.parametrize("dp_shard, cp", [(2, 4), (2, 8)])
def test_fsdp_with_wide_context_parallel_equals_single_process(dp_shard, cp):
    """The 8-GPU layouts (FSDP x CP), on CPU processes: more heads, so cp=8 divides them."""
    run_on_ranks(dp_shard * cp, _check_cp_matches_single_process, dp_shard, cp, WIDE_HEADS)


def test_bad_degrees_name_the_setting():
    args = qwen3_5_args["debugmodel"]  # 4 key heads, 8 value heads, 4 attention heads, 2 KV
    assert context_parallel_problems(args, 2) == []
    assert context_parallel_problems(args, 4) == []  # KV heads repeated twice
    problems = " ".join(context_parallel_problems(args, 3))
    assert "linear_num_key_heads = 4" in problems and "n_heads = 4" in problems
    assert "context_parallel_degree = 3" in problems
    assert "n_kv_heads" in " ".join(context_parallel_problems(args, 8))

    job = _job_config()
    job.parallelism.context_parallel_degree = 3
    job.training.seq_len = 100
    job.validation.enable = True
    problems = " ".join(job_config_problems(args, job))
    assert "training.seq_len = 100 is not divisible by" in problems
    assert "validation.enable = true is not supported yet" in problems
    # The heads' split is the parallel package's rule; the whole-config check adds it. (The
    # default mode, "auto", would pass state passing over 3 chunks instead.)
    job.parallelism.context_parallel_mode = "heads"
    problems = " ".join(configuration_problems(job, world_size=3))
    assert "linear_num_key_heads = 4" in problems
    assert "training.seq_len = 100 is not divisible by" in problems
