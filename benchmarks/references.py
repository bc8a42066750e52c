"""What our step is compared against: transformers' Qwen3.5 on the same tokens, FLA's
delta-rule kernel alone at each GDN layer's shape, and NCCL's all-to-all at our message sizes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from benchmarks.breakdown import device_work
from benchmarks.common import Runtime, guarded, median

# ---------------------------------------------------------------------------------------------
# transformers Qwen3_5ForCausalLM


class TimedSteps(NamedTuple):
    seconds: list[float]  # each timed step, synchronized before and after; slowest rank
    host_seconds: list[float]  # until the step's call returned; slowest rank
    losses: list[torch.Tensor]  # every step's, warm-up included


def timed_steps(
    rt: Runtime, step: Callable[[int], torch.Tensor], warmup: int, steps: int
) -> TimedSteps:
    """The references' timing, as the trainer's (benchmarks/timed_trainer.py): run `warmup`
    then `steps` steps and time the timed ones. Peak memory counts from the
    first timed step. A step's host time ends when its call returns, when the host has
    launched all of it: close to the step time, the GPU waited for the host.

    Python's collector is paused while timing, as torchtitan's trainer does, so a collection
    does not land in one step at random.
    """
    seconds, host_seconds, losses = [], [], []
    gc.collect()
    gc.disable()
    try:
        for index in range(warmup + steps):
            if index == warmup:
                rt.reset_peak_memory()
            rt.synchronize()
            start = time.perf_counter()
            losses.append(step(index))
            returned = time.perf_counter()
            rt.synchronize()
            if index >= warmup:
                seconds.append(time.perf_counter() - start)
                host_seconds.append(returned - start)
    finally:
        gc.enable()
    return TimedSteps(rt.reduce(seconds), rt.reduce(host_seconds), losses)


def transformers_reference(
    model_args, batches, rt: Runtime, *, checkpointing: bool, warmup: int, steps: int, lr: float
) -> dict:
    """transformers' model trained on `batches` on this device, one GPU: bf16 weights and
    AdamW states, eager, sdpa attention, its own loss (full-sequence logits), gradient clipping.

    The rows go in as plain sequences, as a transformers user without flash-attention feeds
    them: attention is causal over the whole row, and the delta rule and conv do not restart
    at documents. The FLA delta rule is used when fla imports (on CUDA), the conv is
    causal-conv1d's when installed, else transformers' torch conv.
    """

    def work() -> dict:
        model = _transformers_model(model_args, rt, checkpointing)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=rt.cuda)

        def step(index: int) -> torch.Tensor:
            inputs = batches[index][0].to(rt.device)
            loss = model(input_ids=inputs, labels=inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        seconds, _, losses = timed_steps(_LocalRuntime(rt), step, warmup, steps)
        return {
            "step_time_s": median(seconds),
            "step_times_s": seconds,
            "losses": [round(x.item(), 5) for x in losses],
            **_local_peak_memory(rt),
        }

    record = {
        "model": f"transformers {TRANSFORMERS_CLASSES[model_args.hf_model_type][2]}",
        "gradient_checkpointing": checkpointing,
        "delta_rule": "fla" if rt.cuda and _installed("fla") else "torch",
        "conv": "causal_conv1d" if rt.cuda and _installed("causal_conv1d") else "torch",
        "attention": "sdpa",
    }
    return {**record, **_guarded_locally(rt, work)}


# The transformers (family, config class, model class) of each `hf_model_type`; the MoE
# models run their experts as transformers ships them (its default experts implementation).
TRANSFORMERS_CLASSES = {
    "qwen3_5_text": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


def _transformers_model(model_args, rt: Runtime, checkpointing: bool):
    import transformers

    family, config_class, model_class = TRANSFORMERS_CLASSES[model_args.hf_model_type]
    modeling = transformers_qwen3_5_module(torch_path=not rt.cuda, family=family)
    fields = model_args.to_hf_config()
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    config = getattr(transformers, config_class)(**fields)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    if rt.cuda:
        # FLA 0.6.0 refuses the gated backward on Hopper with Triton < 3.7.1; titan_gdn lifts
        # that for 128-wide tiles, and transformers calls the same FLA function.
        from titan_gdn.ops.delta_rule.hopper_guard import allow_fla_hopper_bk128

        allow_fla_hopper_bk128()
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(rt.device):
            model = getattr(modeling, model_class)(config)
    finally:
        torch.set_default_dtype(previous)
    model.to(torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def transformers_qwen3_5_module(torch_path: bool, family: str = "qwen3_5"):
    """transformers' modeling module of `family` (qwen3_5, qwen3_5_moe, qwen3_next); with
    `torch_path`, imported with FLA hidden."""
    name = f"transformers.models.{family}.modeling_{family}"
    if not torch_path:
        return importlib.import_module(name)
    # transformers binds FLA's kernels at import whenever fla imports, but they need CUDA: on
    # CPU import the module with fla hidden, so it takes its torch path. The MoE modules import
    # Qwen3.5's and Qwen3-Next's, so those are imported again too.
    hidden = {
        module: sys.modules.pop(module)
        for module in list(sys.modules)
        if module.split(".")[0] == "fla"
    }
    families = ("transformers.models.qwen3_5", "transformers.models.qwen3_next")
    for stale in [n for n in sys.modules if n.startswith(families)]:
        del sys.modules[stale]
    sys.modules["fla"] = None
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


class _LocalRuntime:
    """The parts of Runtime that timed_steps uses, for work on this rank alone (no
    collectives: the other ranks are waiting in a barrier)."""

    def __init__(self, rt: Runtime):
        self._rt = rt

    def synchronize(self) -> None:
        self._rt.synchronize()

    def reset_peak_memory(self) -> None:
        self._rt.reset_peak_memory()

    def reduce(self, values: list[float]) -> list[float]:
        return values


def _local_peak_memory(rt: Runtime) -> dict:
    from benchmarks.common import GIB, _device_module

    stats = _device_module().memory_stats()
    return {
        "peak_reserved_gib": round(stats["reserved_bytes.all.peak"] / GIB, 2),
        "peak_active_gib": round(stats["active_bytes.all.peak"] / GIB, 2),
    }


def _guarded_locally(rt: Runtime, work: Callable[[], dict]) -> dict:
    """`guarded` for work on one rank: the OOM decision needs no agreement."""
    from benchmarks.common import is_out_of_memory

    try:
        return {"status": "ok", **work()}
    except Exception as error:  # noqa: BLE001 - anything but OOM is re-raised
        if not is_out_of_memory(error):
            raise
        message = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    finally:
        rt.free_memory()
    return {"status": "oom", "error": message}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------
# The delta-rule kernel alone


def delta_rule_kernel(
    model_args, seq_len: int, cp: int, cu_seqlens: torch.Tensor, rt: Runtime, repeats: int = 10
) -> dict:
    """FLA's chunk_gated_delta_rule forward and forward + backward at the shape one GDN layer
    runs on this rank: the whole sequence, 1/cp of the heads, this row's documents; bf16
    q, k, v, beta and fp32 decay, as the layer passes them. On CPU the project's torch
    chunked kernel stands in, so the harness runs end to end without a GPU."""
    key_heads, value_heads = model_args.linear_num_key_heads, model_args.linear_num_value_heads
    shape = {
        "tokens": seq_len,
        "key_heads": key_heads // cp,
        "value_heads": value_heads // cp,
        "key_dim": model_args.linear_key_head_dim,
        "value_dim": model_args.linear_value_head_dim,
        "documents": int(cu_seqlens.numel() - 1),
    }

    def work() -> dict:
        kernel, backend = _delta_rule_function(rt.cuda)
        inputs = _delta_rule_inputs(shape, rt.device)
        cu = cu_seqlens.to(rt.device, torch.int32)
        grad = torch.randn_like(inputs[2])

        def forward():
            with torch.no_grad():
                kernel(*inputs, cu)

        def forward_backward():
            kernel(*inputs, cu).backward(grad)

        timer = _kernel_ms if rt.cuda else _median_ms
        return {
            "backend": backend,
            "measure": "GPU kernel time" if rt.cuda else "wall time",
            "forward_ms": timer(forward, rt, repeats),
            "forward_backward_ms": timer(forward_backward, rt, repeats),
        }

    layers = model_args.layer_types.count("linear_attention")
    return {"shape": shape, "layers": layers, **guarded(rt, work)}


def _delta_rule_function(cuda: bool):
    if cuda:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        from titan_gdn.ops.delta_rule.hopper_guard import allow_fla_hopper_bk128

        allow_fla_hopper_bk128()

        def fla(q, k, v, g, beta, cu):
            return chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
            )[0]

        return fla, "fla"
    from titan_gdn.ops.delta_rule import chunk_gated_delta_rule_torch

    return chunk_gated_delta_rule_torch, "torch"


def _delta_rule_inputs(shape: dict, device) -> list[torch.Tensor]:
    tokens, hk, hv = shape["tokens"], shape["key_heads"], shape["value_heads"]
    dk, dv = shape["key_dim"], shape["value_dim"]
    bf16 = {"device": device, "dtype": torch.bfloat16}
    q = torch.randn(1, tokens, hk, dk, **bf16)
    k = torch.randn(1, tokens, hk, dk, **bf16)
    v = torch.randn(1, tokens, hv, dv, **bf16)
    # Decays as the layer makes them: -exp(A_log) * softplus(a + dt_bias), in fp32.
    g = -torch.nn.functional.softplus(torch.randn(1, tokens, hv, device=device)) * 0.5
    beta = torch.rand(1, tokens, hv, **bf16)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _median_ms(fn: Callable[[], None], rt: Runtime, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):  # the first calls autotune and compile
        fn()
    times = []
    for _ in range(repeats):
        rt.synchronize()
        start = time.perf_counter()
        fn()
        rt.synchronize()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1000, 4)


def _kernel_ms(fn: Callable[[], None], rt: Runtime, repeats: int, warmup: int = 3) -> float:
    """GPU kernel time of one call: the durations of the kernels it launches, summed as the
    step breakdown sums the model's delta-rule kernels, averaged over `repeats` calls. Wall
    time would add host work that the model does not repeat per layer (FLA derives its chunk
    indices from cu_seqlens on every call, with host syncs; the model once a step)."""
    for _ in range(warmup):  # the first calls autotune and compile
        fn()
    return round(sum(_kernel_durations_us(fn, rt, repeats)) / repeats / 1000, 4)


def _kernel_durations_us(fn: Callable[[], None], rt: Runtime, repeats: int) -> list[float]:
    """The durations of the GPU kernels that `repeats` back-to-back calls launch."""
    rt.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        rt.synchronize()
    return [e.time_range.elapsed_us() for e in device_work(prof.events())]


# ---------------------------------------------------------------------------------------------
# NCCL all-to-all bandwidth


def all_to_all_probe(message_bytes: list[int], rt: Runtime, repeats: int = 20) -> list[dict]:
    """`all_to_all_single` alone, on all ranks, for each message size (bytes each rank sends,
    split evenly among the ranks): median time and bandwidth (bytes sent per rank / time; the
    bus bandwidth of nccl-tests is this times (n - 1) / n)."""
    results = []
    for size in sorted(set(message_bytes)):
        numel = max(size // 2 // rt.world_size, 1) * rt.world_size
        source = torch.randn(numel, device=rt.device).to(torch.bfloat16)
        target = torch.empty_like(source)
        call = lambda s=source, t=target: dist.all_to_all_single(t, s)  # noqa: E731
        seconds = collective_seconds(call, rt, repeats)
        sent = numel * 2
        record = {
            "bytes": sent,
            "median_ms": round(seconds * 1000, 4),
            "gb_per_s": round(sent / seconds / 1e9, 2),
            "bus_gb_per_s": round(sent / seconds / 1e9 * (rt.world_size - 1) / rt.world_size, 2),
        }
        if rt.cuda:  # the measure of the mixers' all-to-alls in the step breakdown
            kernel_s = _median_kernel_seconds(call, rt, repeats)
            record["kernel_ms"] = round(kernel_s * 1000, 4)
            record["kernel_gb_per_s"] = round(sent / kernel_s / 1e9, 2)
        del source, target
        results.append(record)
    return results


def _median_kernel_seconds(fn: Callable[[], None], rt: Runtime, repeats: int) -> float:
    """The median duration of the NCCL kernel (one per call), slowest rank: without the
    host's launch and synchronization, which wall time holds and the kernel times of the
    training step do not."""
    rt.barrier()
    durations = _kernel_durations_us(fn, rt, repeats)
    return rt.reduce([statistics.median(durations) / 1e6])[0]


def collective_seconds(fn: Callable[[], None], rt: Runtime, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        rt.barrier()
        rt.synchronize()
        start = time.perf_counter()
        fn()
        rt.synchronize()
        times.append(time.perf_counter() - start)
    # The slowest rank's median: the collective ends when every rank has its data.
    return rt.reduce([statistics.median(times)])[0]


@contextlib.contextmanager
def only_on_rank0(rt: Runtime):
    """Run the body on rank 0 while the others wait; yields whether this rank runs it."""
    try:
        yield rt.rank == 0
    finally:
        rt.barrier()
