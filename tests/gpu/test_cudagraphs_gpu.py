"""`compile.cudagraphs`: compiled blocks replayed as CUDA graphs train as the same compiled
blocks launched kernel by kernel, within the kernels' own run-to-run spread, step after step
while the document layout changes (the delta-rule, conv and attention ops, which follow the
documents, run between the graphs), and the graphs are really replayed."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from titan_gdn.model import Qwen35Model, qwen3_5_args
from titan_gdn.parallel.parallelize import parallelize_qwen3_5

pytestmark = pytest.mark.gpu

EOS, SEQ_LEN, LR = 0, 2048, 0.05
DOCUMENTS_PER_STEP = (1, 7, 30, 3, 12, 5)  # a new layout every step


class _Tokenizer:
    eos_id = EOS


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(1, 2048, (1, SEQ_LEN + 1), generator=gen)
    ends = torch.randperm(SEQ_LEN - 1, generator=gen)[: DOCUMENTS_PER_STEP[step] - 1]
    tokens[0, ends] = EOS
    return tokens.cuda()


def _compiled(model: Qwen35Model, cudagraphs: bool) -> Qwen35Model:
    job = JobConfig()
    job.compile.enable, job.compile.components = True, ["model"]
    job.compile.cudagraphs = cudagraphs  # titan_gdn's setting, as the TOML's [compile] sets it
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return parallelize_qwen3_5(model, dims, job)


def _gradients(model, batch, cudagraphs: bool):
    """Loss and gradients of one batch; the parameters' gradients are cleared."""
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    inputs, labels = batch[:, :-1], batch[:, 1:]
    docs = model.get_attention_masks(inputs, _Tokenizer())
    # As the trainer on one GPU: fp32 parameters, bf16 compute.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(inputs, attention_masks=docs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return loss.item(), grads


@torch.no_grad()
def _update(model, grads) -> None:
    """A plain SGD step."""
    for name, p in model.named_parameters():
        p -= LR * grads[name]


def _step(model, batch, cudagraphs: bool):
    loss, grads = _gradients(model, batch, cudagraphs)
    _update(model, grads)
    return loss, grads


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _graph_launches_and_recordings(model, batch) -> tuple[int, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, batch, cudagraphs=True)
    events = {e.key: e.count for e in prof.key_averages()}
    recordings = sum(n for key, n in events.items() if key.startswith("CUDAGraphNode.record"))
    return events.get("cudaGraphLaunch", 0), recordings


@pytest.fixture
def deterministic_kernels():
    """torch's deterministic kernels, flash attention's backward among them: by default it sums
    dq with atomic adds, whose order follows the launch timing, and eager repeats (launched
    alike) then differ from each other less than from a graph replay (launched otherwise),
    so no spread measured between them bounds the replay's error. cuBLAS's fixed workspace,
    which that mode asks for, is set for the whole suite in conftest.py."""
    enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled)


def test_cuda_graph_replays_train_as_the_compiled_blocks(deterministic_kernels):
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen35Model(copy.deepcopy(qwen3_5_args["debugmodel"]))
        model.init_weights()
    reference = _compiled(copy.deepcopy(model), cudagraphs=False)
    graphed = _compiled(model, cudagraphs=True)
    counters.clear()
    for step in range(len(DOCUMENTS_PER_STEP) - 1):
        batch = _batch(step)
        want_loss, want = _gradients(reference, batch, cudagraphs=False)
        # The same step again, kernel by kernel: the kernels' own run-to-run spread (none
        # where every kernel is deterministic).
        _, again = _gradients(reference, batch, cudagraphs=False)
        got_loss, got = _gradients(graphed, batch, cudagraphs=True)
        # Both take the reference's step, so that each step starts both from the same weights
        # (updated in place, as the optimizer updates the graphs' static inputs): with the
        # atomic adds, weights a step apart would differ in every bf16 rounding after them.
        _update(reference, want)
        _update(graphed, want)
        assert got_loss == pytest.approx(want_loss, rel=1e-5), (step, got_loss, want_loss)
        spreads = {name: _relative_error(again[name], grad) for name, grad in want.items()}
        errors = {name: _relative_error(got[name], grad) for name, grad in want.items()}
        print(
            f"step {step}: largest error {max(errors.values()):.2e}, "
            f"spread {max(spreads.values()):.2e}"
        )
        for name, error in errors.items():
            # Replay from stale or wrong buffers gives O(1) errors.
            assert error <= max(1e-4, 4 * spreads[name]), (step, name, error, spreads[name])
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    # Forward and backward of every block, each cut at the delta-rule and conv ops; once warm,
    # a step replays what earlier steps recorded.
    launches, recordings = _graph_launches_and_recordings(
        graphed, _batch(len(DOCUMENTS_PER_STEP) - 1)
    )
    assert launches >= 2 * len(graphed.layers), launches
    assert recordings == 0, recordings
