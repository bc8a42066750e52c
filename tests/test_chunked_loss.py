"""The chunked loss is the plain loss: same value and gradients, alone, in the model, under CP."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import relative_error
from tests.distributed import run_on_ranks
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.loss import (
    OutputHidden,
    build_qwen3_5_loss,
    chunk_loss_and_grad,
    chunked_cross_entropy,
    qwen3_5_loss,
)
from titan_gdn.model import Qwen35Model, qwen3_5_args
from titan_gdn.parallel.parallelize import parallelize_qwen3_5

EOS = 0
SEQ_LEN = 96


def _plain(hidden, weight, labels):
    logits = hidden @ weight.T
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=-100)


def _problem(tokens=203, dim=24, vocab=50):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) / dim**0.5
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = -100
    return hidden, weight, labels


def _loss_and_grads(loss_fn, hidden, weight, labels):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight, labels)
    (loss / 3.0).backward()  # the trainer divides by the global token count
    return loss.detach(), hidden.grad, weight.grad


# With 4 chunks a gradient GEMM: 16 and 50 leave a short last group (of 11 and 3 tokens).
@pytest.mark.parametrize("chunk", [1, 16, 50, 64, 203, 1000])
def test_chunked_equals_plain_cross_entropy(chunk):
    problem = _problem()
    want = _loss_and_grads(_plain, *problem)
    got = _loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk), *problem)
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), got, want, strict=True):
        assert relative_error(a, b) <= 1e-6, name


def test_all_ignored_and_no_grad():
    hidden, weight, labels = _problem(tokens=10)
    assert chunked_cross_entropy(hidden, weight, torch.full_like(labels, -100), 4) == 0
    with torch.no_grad():
        got = chunked_cross_entropy(hidden.requires_grad_(), weight, labels, 3)
    assert not got.requires_grad
    assert relative_error(got, _plain(hidden, weight, labels)) <= 1e-6


def test_bf16_follows_torchtitans_upcast():
    hidden, weight, labels = _problem()
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    got = _loss_and_grads(
        lambda h, w, y: chunked_cross_entropy(h, w, y, 64), hidden, weight, labels
    )
    want = _loss_and_grads(_plain, hidden, weight, labels)
    assert relative_error(got[0], want[0]) <= 1e-6  # the same bf16 logits, upcast
    assert got[2].dtype == torch.bfloat16
    for a, b in zip(got[1:], want[1:], strict=True):
        assert relative_error(a, b) <= 1e-2


def _debug_model(tied: bool) -> Qwen35Model:
    torch.manual_seed(0)
    args = copy.deepcopy(qwen3_5_args["debugmodel"])
    args.enable_weight_tying = tied
    args.n_layers, args.layer_types = 2, ["linear_attention", "full_attention"]
    # A vocabulary size no other matrix of the model has: the GEMM checks below find the
    # vocabulary GEMMs by it.
    args.vocab_size = 2053
    model = Qwen35Model(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_model_chunked_loss_equals_plain_loss(tied):
    model = _debug_model(tied)
    tokens = torch.randint(1, 2048, (2, 65))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :5] = -100
    assert torch.equal(model(inputs, chunked_loss=False), model(inputs))
    grads = []
    for chunked in (False, True):
        model.zero_grad()
        pred = model(inputs, chunked_loss=chunked)
        assert isinstance(pred, OutputHidden) == chunked
        loss = qwen3_5_loss(pred, labels)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain), (chunked_loss, chunked) = grads
    assert relative_error(chunked_loss, plain_loss) <= 1e-6
    assert set(chunked) == set(plain)
    for name in plain:
        assert relative_error(chunked[name], plain[name]) <= 1e-5, name


def test_plain_flavors_and_large_vocab_defaults():
    assert qwen3_5_args["debugmodel"].chunked_loss_tokens == 200
    assert qwen3_5_args["0.8B"].chunked_loss_tokens == 1024
    assert qwen3_5_args["27B"].chunked_loss_tokens == 1024
    small = copy.deepcopy(qwen3_5_args["debugmodel"])
    small.loss_chunk_tokens = None
    assert small.chunked_loss_tokens == 0  # vocab 2048: the plain loss
    model = _debug_model(tied=True)
    model.model_args.loss_chunk_tokens = 0
    assert torch.is_tensor(model(torch.ones(1, 4, dtype=torch.long), chunked_loss=True))


def test_compiled_step_matches():
    job = JobConfig()
    job.compile.enable, job.compile.components, job.compile.backend = True, ["loss"], "aot_eager"
    loss_fn = build_qwen3_5_loss(job)
    hidden, weight, labels = _problem()
    head = torch.nn.Linear(24, 50, bias=False)
    head.weight.data.copy_(weight)
    pred = OutputHidden(hidden.clone().requires_grad_().view(1, -1, 24), head, 64)
    got = loss_fn(pred, labels.view(1, -1))
    got.backward()
    want = _loss_and_grads(_plain, hidden, weight, labels)
    assert relative_error(got.detach(), want[0]) <= 1e-6
    assert relative_error(head.weight.grad, want[2] * 3.0) <= 1e-6
    assert chunk_loss_and_grad is not loss_fn.keywords["step"]


def _job_config(reshard: str) -> JobConfig:
    job = JobConfig()
    job.activation_checkpoint.mode = "none"
    job.training.mixed_precision_param = "float32"
    job.parallelism.fsdp_reshard_after_forward = reshard
    return job


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 2048, (2, SEQ_LEN + 1), generator=gen)
    tokens[0, [0, 1, 30, 47, 48, 80]] = EOS  # documents across the shard boundary
    tokens[1, [10, 60]] = EOS
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[1, 40:52] = -100
    return inputs, labels


def _check_cp_chunked_matches_plain(rank, world_size, tied, reshard):
    reference = _debug_model(tied)
    model = copy.deepcopy(reference)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=world_size, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    dims.build_mesh()
    model = parallelize_qwen3_5(model, dims, _job_config(reshard))
    inputs, labels = _batch()
    valid = (labels != -100).sum()
    docs = DocumentBoundaries.from_tokens(inputs, EOS)

    ref_loss = qwen3_5_loss(reference(inputs, attention_masks=docs), labels)
    (ref_loss / valid).backward()

    shard = slice(rank * SEQ_LEN // world_size, (rank + 1) * SEQ_LEN // world_size)
    pred = model(inputs[:, shard], attention_masks=docs, chunked_loss=True)
    assert isinstance(pred, OutputHidden)
    # "always" reshards the output after forward: the loss has to gather it again.
    assert isinstance(pred.head.weight, DTensor) == (reshard == "always")
    loss = qwen3_5_loss(pred, labels[:, shard])
    (loss / valid).backward()

    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    assert relative_error(total, ref_loss) <= 1e-5
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        error = relative_error(param.grad.full_tensor(), expected[name].grad)
        assert error <= 1e-5, f"{name}: {error:.2e}"


def _check_cp_cases(rank, world_size):
    for tied, reshard in [(True, "default"), (False, "always")]:
        _check_cp_chunked_matches_plain(rank, world_size, tied, reshard)


def test_context_parallel_chunked_loss_equals_plain_loss():
    """cp = 2 (so FSDP over 2 ranks too): tied output kept unsharded after forward, and an
    untied output that FSDP reshards after forward."""
    run_on_ranks(2, _check_cp_cases)


class _VocabGemmDtypes(TorchDispatchMode):
    """The operand dtypes of every matrix product with a `vocab`-sized dimension."""

    GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default}
    GEMMS |= {torch.ops.aten.addmm_.default, torch.ops.aten.addmm.out, torch.ops.aten.bmm.default}

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.seen = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.GEMMS or func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(self.vocab in t.shape for t in tensors):
                self.seen.append((str(func), tuple(t.dtype for t in tensors)))
        return func(*args, **kwargs)


def _vocab_gemms_of_a_step(model, inputs, labels, vocab) -> list:
    docs = DocumentBoundaries.from_tokens(inputs, EOS)
    with _VocabGemmDtypes(vocab) as recorder:
        pred = model(inputs, attention_masks=docs, chunked_loss=True)
        qwen3_5_loss(pred, labels).backward()
    return recorder.seen


def _assert_all_in(seen: list, dtype: torch.dtype) -> None:
    assert len(seen) >= 3, seen  # logits and both gradient GEMMs of at least one group
    wrong = [(op, dtypes) for op, dtypes in seen if any(d != dtype for d in dtypes)]
    assert not wrong, f"vocabulary GEMMs outside {dtype}: {wrong}"


def test_vocabulary_gemms_run_in_autocasts_dtype_with_fp32_parameters():
    """One rank without FSDP: fp32 parameters under torchtitan's autocast. Every product with
    the output weight (logits, d(hidden), d(weight)) runs in bf16; the loss and its gradients
    still reach the fp32 parameters."""
    model = _debug_model(tied=False)
    inputs, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = _vocab_gemms_of_a_step(model, inputs, labels, model.output.weight.shape[0])
    _assert_all_in(seen, torch.bfloat16)
    assert model.output.weight.grad.dtype == torch.float32
    assert model.output.weight.grad.abs().sum() > 0


def test_residual_stream_runs_in_autocasts_dtype_with_fp32_parameters():
    """Under autocast every block's input and output is bf16, as under FSDP's bf16 policy:
    one GPU trains with FSDP's numerics, and full checkpointing saves bf16 block inputs."""
    model = _debug_model(tied=False)
    inputs, _ = _batch()
    seen = []
    for block in model.layers.values():
        block.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(inputs, attention_masks=DocumentBoundaries.from_tokens(inputs, EOS))
    assert len(seen) == len(model.layers)
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
    model(inputs)  # without autocast the fp32 model stays fp32
    assert set(seen[len(model.layers) :]) == {(torch.float32, torch.float32)}


def _check_fsdp_gemms(rank, world_size):
    job = _job_config("default")
    job.training.mixed_precision_param = "bfloat16"
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    model = parallelize_qwen3_5(_debug_model(tied=False), dims, job)
    inputs, labels = _batch()
    seen = _vocab_gemms_of_a_step(model, inputs, labels, model.output.weight.shape[0])
    _assert_all_in(seen, torch.bfloat16)


def test_vocabulary_gemms_run_in_fsdps_param_dtype():
    """FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 master weights) over two ranks."""
    run_on_ranks(2, _check_fsdp_gemms)
