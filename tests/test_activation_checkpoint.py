"""Activation checkpointing of the hybrid blocks.

Full and selective (per layer, per op) checkpointing give the gradients of no checkpointing
(fp32): eager on one process; eager and compiled (aot_eager) with cp=2; eager and compiled on
the FLA delta-rule op (its kernels replaced by CPU stand-ins). Selective per-op checkpointing
keeps what is costly to recompute: in backward the delta-rule forward kernel, attention and
the CP head redistribution do not run again, while with full checkpointing they do (counted
calls of the stand-in kernel, and of dispatcher ops). Each mixer exchanges heads once per
direction in forward and in backward, twice in the backward of a recomputed block.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import OpCounter, perturbed_debug_model, relative_error
from tests.distributed import run_on_ranks
from tests.fla_stand_in import FlaStandIn
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.model import qwen3_5_args
from titan_gdn.model.args import FULL_ATTENTION, LINEAR_ATTENTION
from titan_gdn.ops import delta_rule
from titan_gdn.ops.delta_rule import fla_op
from titan_gdn.parallel.parallelize import parallelize_qwen3_5

EOS = 0
ROWS, SEQ_LEN = 2, 32
# name: (mode, selective_ac_option)
AC_MODES = {
    "full": ("full", "op"),
    "selective op": ("selective", "op"),
    "selective every 2nd layer": ("selective", "2"),
}
ATTENTION_FORWARD = "aten::_scaled_dot_product_flash_attention_for_cpu"
VARLEN_ATTENTION = "titan_gdn::varlen_attention"
HEAD_COLLECTIVE = "_dtensor::shard_dim_alltoall"  # CP moves heads


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 2048, (ROWS, SEQ_LEN + 1), generator=gen)
    tokens[0, [0, 5, 6, 20]] = EOS
    tokens[1, [13, 15]] = EOS
    return tokens


def _job_config(ac: str | None, compile_model: bool) -> JobConfig:
    job = JobConfig()
    job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option = (
        AC_MODES[ac] if ac else ("none", "op")
    )
    job.training.mixed_precision_param = "float32"
    job.compile.enable = compile_model
    job.compile.components = ["model"]
    job.compile.backend = "aot_eager"
    return job


def _parallel_dims(cp: int) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=1, pp=1, ep=1, etp=1, world_size=cp)


def _train_step(model, dims, tokens=slice(None)):
    """Loss of one packed batch (this rank's tokens of it) and its backward.

    Returns the gradients by parameter name (as in the unwrapped model) and the ops that ran,
    {"forward": Counter, "backward": Counter} (forward: as the profiler names them; a dispatch
    mode would keep torch.compile from compiling the forward).
    """
    batch = _batch()
    inputs, labels = batch[:, :-1], batch[:, 1:]
    docs = DocumentBoundaries.from_tokens(inputs, EOS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as forward:
        logits = model(inputs[:, tokens], attention_masks=docs)
    forward_ops = Counter(e.name for e in forward.events() if not _inside_itself(e))
    loss = F.cross_entropy(logits.flatten(0, 1), labels[:, tokens].flatten(), reduction="sum")
    with OpCounter() as backward_ops:
        (loss / labels.numel()).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if dims.fsdp_enabled else param.grad
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        grads[name] = grad
    backward_ops = Counter({_profiler_name(op): n for op, n in backward_ops.calls.items()})
    return grads, {"forward": forward_ops, "backward": backward_ops}


def _inside_itself(event) -> bool:
    """Whether a profiled op runs inside a call of the same op: selective checkpointing's
    caching mode dispatches each op again, under the first call."""
    parent = event.cpu_parent
    while parent is not None and parent.name != event.name:
        parent = parent.cpu_parent
    return parent is not None


def _profiler_name(op) -> str:
    """An op as the profiler names it: "namespace::name"."""
    return str(op).replace(".", "::", 1).rsplit(".", 1)[0]


def _moves_activations(op) -> bool:
    """A DTensor or functional collective op: the ops that could exchange activations (FSDP's
    parameter collectives are c10d's own; "gloo:..." names the backend's work inside an op)."""
    return op.partition("::")[0] in ("_c10d_functional", "_dtensor")


def _checkpointed(ac, compile_model, dims):
    torch._dynamo.reset()  # a fresh cache per model: no recompile limit across cases
    return parallelize_qwen3_5(perturbed_debug_model(), dims, _job_config(ac, compile_model))


def _assert_same_grads(grads, reference, tolerance, label):
    for name, grad in grads.items():
        error = relative_error(grad, reference[name])
        assert error <= tolerance, f"{label}, {name}: {error:.2e}"


@pytest.mark.parametrize("ac", list(AC_MODES))
def test_checkpointing_keeps_the_gradients(ac):
    dims = _parallel_dims(1)
    reference, _ = _train_step(perturbed_debug_model(), dims)
    grads, _ = _train_step(_checkpointed(ac, False, dims), dims)
    _assert_same_grads(grads, reference, 1e-6, ac)


def _check_context_parallel(rank, world_size):
    dims = _parallel_dims(world_size)
    dims.build_mesh()
    shard = SEQ_LEN // world_size
    tokens = slice(rank * shard, (rank + 1) * shard)
    reference, _ = _train_step(perturbed_debug_model(), _parallel_dims(1))
    mixers = len(qwen3_5_args["debugmodel"].layer_types)
    # Blocks whose backward runs their forward again, exchanges included.
    recomputed = {None: 0, "selective op": 0, "selective every 2nd layer": mixers // 2}
    recomputed["full"] = mixers
    # Compiled per-layer mode is left out (it is full or nothing per block): compiles are slow.
    cases = [
        (None, False),
        *((ac, False) for ac in AC_MODES),
        ("full", True),
        ("selective op", True),
    ]
    for ac, compile_model in cases:
        model = _checkpointed(ac, compile_model, dims)
        if compile_model:  # compiled first, so that tracing's ops are not counted
            _train_step(model, dims, tokens)
            model.zero_grad(set_to_none=True)
        grads, ops = _train_step(model, dims, tokens)
        label = f"cp={world_size} {ac} {compile_model=}"
        _assert_same_grads(grads, reference, 1e-5, label)
        # One redistribution per direction per mixer, in forward and in backward; a recomputed
        # forward sends its two again, while selective per-op checkpointing keeps them.
        exchanges = {phase: calls[HEAD_COLLECTIVE] for phase, calls in ops.items()}
        expected = {"forward": 2 * mixers, "backward": 2 * (mixers + recomputed[ac])}
        assert exchanges == expected, (label, exchanges)
        # Nothing else moves activations between the cp ranks.
        others = [op for calls in ops.values() for op in calls if _moves_activations(op)]
        assert set(others) <= {HEAD_COLLECTIVE}, (label, others)


def test_checkpointing_with_context_parallel_keeps_the_gradients():
    run_on_ranks(2, _check_context_parallel)


@pytest.fixture
def fla_stand_in(monkeypatch):
    """The model's delta rule runs through the FLA op, on the CPU stand-in for FLA's kernels."""
    stand_in = FlaStandIn()
    monkeypatch.setattr(fla_op, "load_fla_kernels", stand_in.kernels)
    monkeypatch.setattr(delta_rule, "resolve_delta_rule_backend", lambda device, name: "fla")
    return stand_in


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_selective_op_checkpointing_does_not_rerun_the_kernels(fla_stand_in, compile_model):
    """On the FLA op (CPU stand-in kernels): the gradients of no checkpointing, and forward
    kernels run again in backward only with full checkpointing."""
    dims = _parallel_dims(1)
    layer_types = Counter(qwen3_5_args["debugmodel"].layer_types)
    reference, _ = _train_step(perturbed_debug_model(), dims)
    reruns = {}
    for ac in ("selective op", "full"):
        model = _checkpointed(ac, compile_model, dims)
        fla_stand_in.forward_calls = 0
        grads, ops = _train_step(model, dims)
        # Forward ran the kernel once per GDN layer; backward may have run it again.
        delta_rule_reruns = fla_stand_in.forward_calls - layer_types[LINEAR_ATTENTION]
        reruns[ac] = (delta_rule_reruns, ops["backward"][ATTENTION_FORWARD])
        _assert_same_grads(grads, reference, 1e-6, f"{ac} {compile_model=}")
    assert reruns["selective op"] == (0, 0), reruns
    assert reruns["full"] == (layer_types[LINEAR_ATTENTION], layer_types[FULL_ATTENTION]), reruns


def _varlen_attention_reruns(model) -> tuple[dict, int]:
    """A training step's gradients, and how often the varlen attention op computed in its
    backward (profiled: its CPU reference backward records autograd, which a dispatch mode
    prevents; an op that selective checkpointing serves from its cache is dispatched too, but
    computes no matrix product inside)."""
    batch = _batch()
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = model(inputs, attention_masks=DocumentBoundaries.from_tokens(inputs, EOS))
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as backward:
        (loss / labels.numel()).backward()
    runs = sum(
        e.name == VARLEN_ATTENTION and not _inside_itself(e) and _multiplies_matrices(e)
        for e in backward.events()
    )
    grads = {
        name.replace("_checkpoint_wrapped_module.", ""): param.grad
        for name, param in model.named_parameters()
    }
    return grads, runs


def _multiplies_matrices(event) -> bool:
    return any(
        child.name in ("aten::bmm", "aten::mm", "aten::einsum") or _multiplies_matrices(child)
        for child in event.cpu_children
    )


def test_selective_op_checkpointing_keeps_the_varlen_attention():
    """The CUDA default attention, the varlen op (on CPU its per-document reference), is kept
    by selective per-op checkpointing and recomputed by full checkpointing, with the gradients
    of no checkpointing."""
    dims = _parallel_dims(1)
    reference, _ = _varlen_attention_reruns(perturbed_debug_model(attn_backend="varlen"))
    reruns = {}
    for ac in ("selective op", "full"):
        torch._dynamo.reset()
        model = perturbed_debug_model(attn_backend="varlen")
        model = parallelize_qwen3_5(model, dims, _job_config(ac, compile_model=False))
        grads, reruns[ac] = _varlen_attention_reruns(model)
        _assert_same_grads(grads, reference, 1e-6, ac)
    attention_layers = Counter(qwen3_5_args["debugmodel"].layer_types)[FULL_ATTENTION]
    assert reruns == {"selective op": 0, "full": attention_layers}, reruns


LONG_SEQ_LEN = 1024  # long enough that activations, not weights, dominate what is saved


def _saved_bytes(dims, tokens=slice(None)) -> int:
    """Bytes that a compiled, fully checkpointed forward saves for backward."""
    model = _checkpointed("full", True, dims)
    gen = torch.Generator().manual_seed(5)
    inputs = torch.randint(1, 2048, (1, LONG_SEQ_LEN), generator=gen)
    inputs[0, ::100] = EOS
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs[:, tokens], attention_masks=DocumentBoundaries.from_tokens(inputs, EOS))
    return sum(saved)


def _check_saved_under_context_parallel(rank, world_size, saved_at_cp1):
    dims = _parallel_dims(world_size)
    dims.build_mesh()
    shard = LONG_SEQ_LEN // world_size
    saved = _saved_bytes(dims, slice(rank * shard, (rank + 1) * shard))
    # Each rank keeps its shard of the block inputs; the head-sharded exchange buffers (whole
    # sequence) must be recomputed, not kept: torch 2.11's partitioner kept a functional
    # collective's output: 47 MB per rank against 31 MB at cp=1 here.
    assert saved < saved_at_cp1, f"rank {rank}: {saved} bytes saved, {saved_at_cp1} at cp=1"


def test_full_checkpointing_with_context_parallel_saves_less_than_one_process():
    saved_at_cp1 = _saved_bytes(_parallel_dims(1))
    run_on_ranks(2, _check_saved_under_context_parallel, saved_at_cp1)
