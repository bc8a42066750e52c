"""The FLA delta-rule op on CUDA against FLA's own autograd Function.

Eager and compiled (inductor) calls of the op give FLA's outputs and gradients, its fake
implementation agrees with the kernels (opcheck), its backward runs no FLA forward kernel, and
a compiled model with selective op checkpointing trains like the eager model without
checkpointing while the delta-rule forward runs once per layer. Needs a CUDA device: CI
deselects it with ``-m "not gpu"``.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import relative_error
from tests.gpu.test_delta_rule_gpu import random_inputs
from titan_gdn.model import Qwen35Model, qwen3_5_args
from titan_gdn.model.args import LINEAR_ATTENTION
from titan_gdn.ops.delta_rule import fla_op, gated_delta_rule
from titan_gdn.parallel.parallelize import parallelize_qwen3_5

pytestmark = pytest.mark.gpu

INPUT_NAMES = ("q", "k", "v", "g", "beta")
MODEL_SEQ_LEN = 2048
SIZES = pytest.mark.parametrize(
    ("tokens", "documents", "key_heads", "value_heads", "head_dim"),
    [(300, 5, 1, 2, 128), (8192, 17, 16, 32, 128)],
    ids=["small", "qwen3.5-size"],
)


@pytest.fixture(autouse=True)
def fla_triton_path(monkeypatch):
    """FLA's public function on its Triton path, the one the op calls (not FlashQLA), with
    the Hopper guard lift in place for both."""
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    fla_op.load_fla_kernels()


class CountingKernels:
    def __init__(self, kernels):
        self.calls = {"forward": 0, "backward": 0}
        self.kernels = kernels._replace(
            forward=self._counted("forward", kernels.forward),
            backward=self._counted("backward", kernels.backward),
        )

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


def _padded(cu_seqlens, tokens):
    """The fixed-capacity form the model passes: the end repeated up to tokens + 1 entries."""
    padding = cu_seqlens[-1:].expand(tokens + 1 - len(cu_seqlens))
    return torch.cat([cu_seqlens, padding])


def _as_layer_passes_them(inputs):
    """q, k, v as strided slices of one tensor, as the GDN layer passes the conv output."""
    parts = [inputs[name].flatten(2) for name in ("q", "k", "v")]
    qkv = torch.cat(parts, dim=-1)
    slices = qkv.split([p.shape[-1] for p in parts], dim=-1)
    return {
        **inputs,
        **{n: s.view_as(inputs[n]) for n, s in zip(("q", "k", "v"), slices, strict=True)},
    }


def _output_and_grads(fn, inputs, cu_seqlens):
    leaves = [inputs[name].detach().requires_grad_() for name in INPUT_NAMES]
    out = fn(*leaves, cu_seqlens)
    grads = torch.autograd.grad((out.float() * inputs["grad_out"].float()).sum(), leaves)
    return {"o": out, **{f"d{name}": grad for name, grad in zip(INPUT_NAMES, grads, strict=True)}}


def _fla_function(q, k, v, g, beta, cu_seqlens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, _ = chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens
    )
    return o


def _op(q, k, v, g, beta, cu_seqlens):
    return gated_delta_rule(q, k, v, g, beta, cu_seqlens, backend="fla")


@SIZES
def test_op_eager_and_compiled_equal_fla(tokens, documents, key_heads, value_heads, head_dim):
    inputs = _as_layer_passes_them(
        random_inputs(tokens, tokens, documents, key_heads, value_heads, head_dim)
    )
    expected = _output_and_grads(_fla_function, inputs, inputs["cu_seqlens"])
    padded = _padded(inputs["cu_seqlens"], tokens)
    compiled = torch.compile(_op, fullgraph=True)
    for label, fn in (("eager", _op), ("compiled", compiled)):
        actual = _output_and_grads(fn, inputs, padded)
        errors = {name: relative_error(actual[name], value) for name, value in expected.items()}
        print(f"op {label} vs FLA: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        # The same kernels on the same inputs: only a different autotuned config could differ.
        assert all(error <= 1e-3 for error in errors.values()), (label, errors)
        assert all(actual[name].dtype == value.dtype for name, value in expected.items())


def test_op_passes_opcheck():
    inputs = random_inputs(300, 300, 5, 1, 2, 128)
    tensors = [inputs[name].detach().requires_grad_() for name in INPUT_NAMES]
    args = (*tensors, _padded(inputs["cu_seqlens"], 300), 128**-0.5)
    torch.library.opcheck(torch.ops.titan_gdn.gated_delta_rule_fla, args)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backward_runs_no_forward_kernel(monkeypatch, compiled):
    counting = CountingKernels(fla_op.load_fla_kernels())
    monkeypatch.setattr(fla_op, "load_fla_kernels", lambda: counting.kernels)
    inputs = random_inputs(300, 300, 5, 1, 2, 128)
    fn = torch.compile(_op, fullgraph=True) if compiled else _op
    _output_and_grads(fn, inputs, inputs["cu_seqlens"])
    assert counting.calls == {"forward": 1, "backward": 1}


@pytest.mark.gpu_alone  # the device's free memory: another process's allocations would move it
def test_local_memory_reserved_by_autotuning_is_given_back():
    """A first use of the op gives back a grown CUDA stack (the local memory that spilling
    autotune configurations leave reserved). The stack is grown by hand first, so the test
    does not depend on whether this machine's autotune cache is cold."""
    import ctypes

    from titan_gdn.ops import local_memory

    driver = local_memory._cuda_driver()
    inputs = random_inputs(301, 301, 5, 1, 2, 128)  # a shape no other test uses: a first use
    _output_and_grads(_op, inputs, inputs["cu_seqlens"])  # tuned (or cached) at this shape
    torch.cuda.synchronize()
    assert driver.cuCtxSetLimit(0, ctypes.c_size_t(32768)) == 0
    torch.ones(1, device="cuda").add_(1)  # a launch, should the driver resize lazily
    torch.cuda.synchronize()
    free_grown, _ = torch.cuda.mem_get_info()
    local_memory._seen.clear()
    _output_and_grads(_op, inputs, inputs["cu_seqlens"])  # the reset runs with kernels queued
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    stack = local_memory.stack_limit(driver)
    print(f"stack {stack} B/thread, {(free_after - free_grown) / 2**30:.2f} GiB freed")
    assert stack is not None and stack <= local_memory.DEFAULT_STACK_BYTES
    # 32 KB for every thread an H200 holds is 8 GiB; most of it must come back.
    assert free_after - free_grown > 2 * 2**30


def _model_step(model, tokens):
    inputs = tokens[:, :-1]
    docs = model.get_attention_masks(inputs, type("T", (), {"eos_id": 0}), None)
    logits = model(inputs, attention_masks=docs)
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    grads = {}
    for name, param in model.named_parameters():
        grads[name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")] = (
            param.grad
        )
    return logits, grads


def _parallelized(model, ac_mode, compile_model):
    job = JobConfig()
    job.activation_checkpoint.mode = ac_mode
    job.activation_checkpoint.selective_ac_option = "op"
    job.compile.enable, job.compile.components = compile_model, ["model"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return parallelize_qwen3_5(model, dims, job)


def _grad_errors(grads, ref_grads):
    return {name: relative_error(grad, ref_grads[name]) for name, grad in grads.items()}


def _worst(errors):
    worst = max(errors, key=errors.get)
    return f"{worst} {errors[worst]:.1e}"


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_selective_checkpointing_keeps_the_kernel_outputs(monkeypatch, compile_model):
    """fp32 debug model with FLA and flex: selective op AC vs the same model without AC, both
    eager or both compiled (inductor); the delta-rule forward runs once per layer."""
    torch.manual_seed(0)
    args = copy.deepcopy(qwen3_5_args["debugmodel"])
    args.attn_backend = "flex"  # fp32 attention: torch's flash and cuDNN kernels take 16-bit
    eager = Qwen35Model(args).cuda()
    eager.init_weights()
    torch._dynamo.reset()
    without_ac = _parallelized(copy.deepcopy(eager), "none", compile_model)
    model = _parallelized(copy.deepcopy(eager), "selective", compile_model)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 2048, (2, MODEL_SEQ_LEN + 1), generator=gen)
    tokens[:, torch.randint(0, MODEL_SEQ_LEN, (12,), generator=gen)] = 0
    tokens = tokens.cuda()
    ref_logits, ref_grads = _model_step(without_ac, tokens)

    counting = CountingKernels(fla_op.load_fla_kernels())
    with monkeypatch.context() as patch:
        patch.setattr(fla_op, "load_fla_kernels", lambda: counting.kernels)
        logits, grads = _model_step(model, tokens)

    gdn_layers = qwen3_5_args["debugmodel"].layer_types.count(LINEAR_ATTENTION)
    assert counting.calls == {"forward": gdn_layers, "backward": gdn_layers}
    label = "compiled" if compile_model else "eager"
    logits_error, errors = relative_error(logits, ref_logits), _grad_errors(grads, ref_grads)
    print(
        f"selective AC ({label}) vs {label} without AC: logits {logits_error:.1e}, worst grad "
        f"{_worst(errors)}"
    )
    # fp32 around FLA's kernels, which multiply in TF32: far below what a wrong gradient gives.
    bounds = dict.fromkeys(errors, 1e-2)
    if compile_model:
        # Inductor fuses the elementwise code around the kernels otherwise with AC than without,
        # which moves the TF32 kernels' inputs by rounding. A gradient that is a sum of nearly
        # cancelling terms (A_log's, over every token) then moves far more than its terms: the
        # same model compiled and eager, both without AC, differ by as much (0.36 relative in
        # A_log's on one H200). Such a gradient is held to 4x that difference; a wrong saved
        # output would move every gradient, the weights' among them, far past 1e-2.
        eager_logits, eager_grads = _model_step(eager, tokens)
        spread = _grad_errors(ref_grads, eager_grads)
        print(
            f"compiled vs eager, both without AC: logits "
            f"{relative_error(ref_logits, eager_logits):.1e}, worst grad {_worst(spread)}"
        )
        bounds = {name: max(1e-2, 4 * spread[name]) for name in errors}
    assert logits_error <= 1e-2
    over = {name: (errors[name], bounds[name]) for name in errors if errors[name] > bounds[name]}
    assert not over, over
