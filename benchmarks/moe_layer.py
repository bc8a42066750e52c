"""One Qwen3.5 MoE decoder layer alone, forward + backward in bf16: ours against transformers'
`Qwen3_5MoeDecoderLayer` with the same weights, for each mixer (Gated DeltaNet and gated
attention), at each row length, on rows whose documents are cut like each corpus.

    python -m benchmarks.moe_layer --out docs/results/moe_layer_h200.json

The shape is the flavor's (`--flavor`, default 35B-A3B) with one layer. Ours is the model's
`DecoderBlock`, compiled as the trainer compiles an MoE block under `compile.enable` (each part
but the routed experts; `--compile-backend`, none: eager); transformers' layer, eager as its
models run by default, gets the same weights through the state dict adapter and runs
with each experts implementation the installed transformers has among `eager` (its experts
module's own loop over the experts hit) and `grouped_mm` (what its `from_pretrained` picks where
it can). A row of `--tokens` tokens holds the first documents of the corpus
(`benchmarks/corpora.py`), the last one cut at the row end. Ours gets the row's
`DocumentBoundaries` as the model's forward gets them; transformers gets positions restarting
at each document (RoPE, and the document-causal mask that its `create_causal_mask` builds from
them, as its model does) and, in the GDN layer, `cu_seq_lens_q` for FLA's delta rule (on CPU its
torch delta rule refuses them, so there it runs the row as one sequence). Its conv reads across
documents either way (its torch conv, and causal-conv1d gets no `seq_idx`). Boundaries, masks
and RoPE tables are built once per row, outside the timing, as a model builds them once for
all its layers.

Before timing, each transformers candidate is checked against ours on a short row
(`--check-tokens`): each of the layer's two residual branches (input norm and mixer;
post-attention norm and MoE block), given the same input on both sides, its output and input
gradient within `--tolerance` (relative), or the benchmark stops with an error, so that a
broken comparison does not show as a fast time. Branch by branch, because through the whole
layer the bf16 rounding differences of the mixers move some tokens across the router's top-k
(a few percent of them at 256 experts), which is no error of either. The GDN check row is one
document (transformers' conv ignores documents); the attention check row holds three.

Per point: the median of `--reps` forward + backward calls after `--warmup` (CUDA events; wall
time on CPU); `step_peak_gib`, the most memory the call allocates above what was held before
it (activations and gradients); for transformers, its time over ours. For ours also the time
by part, from a torch.profiler trace of `--profile-steps` more calls (GPU kernel time; op self
time on CPU): router, permutation (counts, sort, gather, padding), grouped GEMMs (the experts'
SwiGLU), combine (unpadding, unsort, weighted sum), shared expert (with its gate), mixer, and
other (norms, residuals, gradient accumulation). The parts are profiler ranges opened by hooks
on the block's modules and around `experts_swiglu`, the model unchanged; backward work goes to
the part whose forward op made its autograd node. Grouped-GEMM TFLOP/s counts
2 * tokens * top_k * 3 * I * D forward (gate, up, down), three times that forward + backward,
over the GEMM kernels inside the grouped-GEMM part.

The JSON is rewritten after every entry. On a fresh GPU FLA tunes the GDN layer's kernels at their
first launch (minutes at 35B-A3B's heads), so a run may not fit one time-limited command: rerun
the same command with `--resume` on the same machine, and it keeps the points the file holds
(every candidate measured) and measures the others, a point cut short from its start.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import shlex
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function

from benchmarks import records
from benchmarks.breakdown import _Chains, _kernel_samples, _self_time_samples, range_owner
from benchmarks.corpora import CORPORA, document_lengths
from benchmarks.references import TRANSFORMERS_CLASSES, transformers_qwen3_5_module
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.layers import moe
from titan_gdn.layers.rope import rope_cos_sin
from titan_gdn.model.args import Qwen35ModelArgs
from titan_gdn.model.flavors import qwen3_5_args
from titan_gdn.model.hf_config import MOE
from titan_gdn.model.layer_types import FULL_ATTENTION, LINEAR_ATTENTION
from titan_gdn.model.model import DecoderBlock
from titan_gdn.model.state_dict_adapter import Qwen35StateDictAdapter
from titan_gdn.ops.attention import document_causal_block_mask, resolve_attn_backend
from titan_gdn.parallel.parallelize import compile_moe_block

MODULE = "benchmarks.moe_layer"
MIXERS = (LINEAR_ATTENTION, FULL_ATTENTION)
OURS = "titan_gdn"
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm")
PARTS = ("router", "permutation", "grouped_gemm", "combine", "shared_expert", "mixer", "other")
PART_RANGE = "bench::moe_layer "
GEMM_OPS = ("aten::_grouped_mm", "aten::mm", "aten::addmm", "aten::bmm")
EOS = 0
GIB = 1024**3


class ParityError(RuntimeError):
    """transformers' layer and ours compute different functions: the comparison is broken."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--flavor", default="35B-A3B", help="an MoE flavor: its shape, 1 layer")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--corpora", nargs="+", choices=CORPORA, default=list(CORPORA))
    parser.add_argument("--mixers", nargs="+", choices=MIXERS, default=list(MIXERS))
    parser.add_argument(
        "--transformers-experts",
        nargs="+",
        default=None,
        help=f"transformers' experts implementations among {EXPERTS_IMPLEMENTATIONS} "
        "(default: those the installed transformers has)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend for our block, compiled as the trainer compiles an MoE "
        "block (compile.enable in the shipped configs); none: eager",
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--check-tokens", type=int, default=512)
    parser.add_argument("--tolerance", type=float, default=2e-2)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the points --out already holds and measure only the others (a run cut short "
        "by a time limit, continued on the same machine)",
    )
    return parser.parse_args(argv)


def installed_experts_implementations() -> list[str]:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the experts interface: its loop only
        return ["eager"]
    return [
        name for name in EXPERTS_IMPLEMENTATIONS if name == "eager" or name in ALL_EXPERTS_FUNCTIONS
    ]


def option_problems(args: argparse.Namespace) -> list[str]:
    """Bad settings, named with their fix, before any layer is built."""
    found = []
    flavor = qwen3_5_args.get(args.flavor)
    if flavor is None:
        found.append(
            f"--flavor {args.flavor!r} is not a flavor: choose one of {list(qwen3_5_args)}"
        )
    elif flavor.num_experts == 0 or flavor.hf_model_type != MOE:
        moe_flavors = [n for n, a in qwen3_5_args.items() if a.hf_model_type == MOE]
        found.append(
            f"--flavor {args.flavor} is not a Qwen3.5 MoE flavor: choose one of {moe_flavors}"
        )
    installed = installed_experts_implementations()
    missing = sorted(set(args.transformers_experts or []) - set(installed))
    if missing:
        found.append(
            f"--transformers-experts {missing}: the installed transformers has only {installed}"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        found.append("--device cuda: no CUDA device here; pass --device cpu (a tiny shape)")
    short = [n for n in args.tokens + [args.check_tokens] if n < 3]
    if short:
        found.append(f"--tokens / --check-tokens {short}: a row needs at least 3 tokens")
    if args.reps < 1 or args.profile_steps < 1:
        found.append("--reps and --profile-steps: at least 1 each (the median, the profile)")
    if args.resume and args.out is None:
        found.append("--resume: continues the file of --out; pass --out")
    return found


# What a resumed run must share with the file it continues: every point measured the same way.
RESUME_SETTINGS = (
    "flavor",
    "compile_backend",
    "reps",
    "warmup",
    "profile_steps",
    "check_tokens",
    "tolerance",
)


def resume_problems(previous: dict, result: dict) -> list[str]:
    """How the file to continue differs from this run's settings, each with its fix."""
    if previous.get("kind") != "moe_layer" or "settings" not in previous:
        return ["--resume: --out holds no moe_layer run with its settings; use another --out"]
    found = [
        f"--{name.replace('_', '-')}: the file was measured with {previous['settings'][name]!r}, "
        f"this run asks {result['settings'][name]!r}"
        for name in RESUME_SETTINGS
        if previous["settings"].get(name) != result["settings"][name]
    ]
    if previous["transformers"] != result["transformers"]:
        found.append(
            f"transformers: the file compared against {previous['transformers']}, this run "
            f"against {result['transformers']} (--transformers-experts, or the installed one)"
        )
    return [p + "; drop --resume or use another --out" for p in found]


# ---------------------------------------------------------------------------------------------
# The two layers, with the same weights


def layer_args(flavor: str, mixer: str) -> Qwen35ModelArgs:
    """The flavor's shape with one layer, of `mixer`."""
    return replace(qwen3_5_args[flavor], n_layers=1, layer_types=[mixer], mlp_only_layers=[])


@dataclass
class LayerPair:
    """Our block and transformers' layer holding the same weights, and what runs theirs."""

    args: Qwen35ModelArgs
    ours: DecoderBlock
    theirs: torch.nn.Module
    config: Any  # transformers' config: its `_experts_implementation` picks their experts
    modeling: ModuleType  # transformers' modeling module the layer comes from
    delta_rule: str  # transformers' delta rule: "fla" (told the documents) or "torch"


def build_layers(
    args: Qwen35ModelArgs, device: torch.device, modeling, delta_rule: str, seed: int = 0
) -> LayerPair:
    """Our block initialised as the model initialises it, bf16, and transformers' layer holding
    the same weights (the state dict adapter's names)."""
    mixer = args.layer_types[0]
    torch.manual_seed(seed)
    with torch.device(device):
        ours = DecoderBlock(args, mixer, moe=True)
        ours.init_weights(args.initializer_range)
    ours.to(torch.bfloat16)
    config = transformers_config(args)
    layer_class = getattr(
        modeling, TRANSFORMERS_CLASSES[args.hf_model_type][2].replace("ForCausalLM", "DecoderLayer")
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            theirs = layer_class(config, layer_idx=0)
    finally:
        torch.set_default_dtype(previous)
    copy_weights(ours, theirs, args)
    return LayerPair(args, ours, theirs, config, modeling, delta_rule)


def transformers_config(args: Qwen35ModelArgs):
    import transformers

    fields = args.to_hf_config()
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    config = getattr(transformers, TRANSFORMERS_CLASSES[args.hf_model_type][1])(**fields)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    config.use_cache = False
    return config


def copy_weights(ours: DecoderBlock, theirs, args: Qwen35ModelArgs) -> None:
    """Our block's weights into transformers' layer, named by the state dict adapter (which maps
    model state dicts: the block is the model's layer 0)."""
    block_prefix, hf_prefix = "layers.0.", "model.layers.0."
    state = {block_prefix + k: v for k, v in ours.state_dict().items()}
    hf_state = Qwen35StateDictAdapter(args, None).to_hf(state)
    theirs.load_state_dict({k.removeprefix(hf_prefix): v for k, v in hf_state.items()}, strict=True)


# ---------------------------------------------------------------------------------------------
# Rows and what each layer is told about their documents


def row_lengths(corpus: str, tokens: int) -> list[int]:
    """The documents of a row of `tokens` tokens: the corpus's first ones, the last one cut."""
    lengths, total = [], 0
    for length in document_lengths(corpus, tokens):
        lengths.append(min(length, tokens - total))
        total += lengths[-1]
        if total == tokens:
            return lengths
    raise AssertionError("document_lengths returned fewer tokens than asked for")


def boundaries(lengths: list[int], args: Qwen35ModelArgs, device) -> DocumentBoundaries:
    """As the model's `get_attention_masks` builds them: from EOS tokens ending each document."""
    tokens = torch.ones(1, sum(lengths), dtype=torch.long)
    tokens[0, torch.tensor(lengths).cumsum(0) - 1] = EOS
    docs = DocumentBoundaries.from_tokens(tokens.to(device), EOS)
    if resolve_attn_backend(docs.document_ids.device, args.attn_backend) == "flex":
        docs = docs.with_block_mask(document_causal_block_mask(docs.document_ids))
    return docs


def ours_forward(layers: LayerPair, docs: DocumentBoundaries):
    """Our block's forward on a row, its output only (the routing is for the aux loss)."""
    args = layers.args
    rope = rope_cos_sin(docs.position_ids, args.rotary_dim, args.rope_theta, torch.bfloat16)
    return lambda x: layers.ours(x, docs, rope)[0]


def theirs_forward(layers: LayerPair, docs: DocumentBoundaries):
    """transformers' layer on a row, told of its documents as its model would tell it."""
    kwargs = transformers_kwargs(layers, docs)
    return lambda x: layers.theirs(x, **kwargs)


def transformers_kwargs(layers: LayerPair, docs: DocumentBoundaries) -> dict:
    """What transformers' model hands each layer about the row: RoPE of the positions in each
    document, the document-causal mask its `create_causal_mask` makes of them (attention), and
    the documents' cu_seqlens for FLA's delta rule (GDN)."""
    from transformers.masking_utils import create_causal_mask

    config, positions = layers.config, docs.position_ids
    probe = torch.empty(1, positions.shape[1], config.hidden_size, dtype=torch.bfloat16)
    probe = probe.to(positions.device)
    rotary = layers.modeling.Qwen3_5MoeTextRotaryEmbedding(config).to(positions.device)
    # The rotary embedding takes multimodal RoPE's three position rows, [3, B, T] (transformers
    # 5.17 indexes them so; later versions also expand [B, T]); text gives all three the same.
    rope_positions = positions.expand(3, *positions.shape)
    kwargs = {"position_embeddings": rotary(probe, rope_positions), "position_ids": positions}
    if layers.theirs.block_type == FULL_ATTENTION:
        # The cache argument is unnamed: transformers renamed it (past_key_values -> cache).
        no_padding, no_cache = None, None
        kwargs["attention_mask"] = create_causal_mask(
            config, probe, no_padding, no_cache, position_ids=positions
        )
    elif layers.delta_rule == "fla":
        kwargs["cu_seq_lens_q"] = docs.cu_seqlens
    return kwargs


def residual_branches(layers: LayerPair, docs: DocumentBoundaries) -> dict:
    """Per residual branch of the layer, (ours, transformers'): its norm and its mixer or MoE
    block, each a function of the branch's input. The check gives both the same input: through
    the whole layer, bf16 rounding differences of the mixer move tokens across the router's
    top-k (at 256 experts, a few percent of them), which is no error of either."""
    ours, theirs, args = layers.ours, layers.theirs, layers.args
    rope = rope_cos_sin(docs.position_ids, args.rotary_dim, args.rope_theta, torch.bfloat16)
    kwargs = transformers_kwargs(layers, docs)
    if theirs.block_type == FULL_ATTENTION:
        ours_mixer = lambda h: ours.self_attn(h, docs, rope)  # noqa: E731
        theirs_mixer = lambda h: theirs.self_attn(hidden_states=h, **kwargs)[0]  # noqa: E731
    else:
        ours_mixer = lambda h: ours.linear_attn(h, docs)  # noqa: E731
        gdn_kwargs = {k: v for k, v in kwargs.items() if k == "cu_seq_lens_q"}
        theirs_mixer = lambda h: theirs.linear_attn(hidden_states=h, **gdn_kwargs)  # noqa: E731

    def theirs_moe(x):
        out = theirs.mlp(theirs.post_attention_layernorm(x))
        return out[0] if isinstance(out, tuple) else out

    return {
        "mixer": (
            lambda x: ours_mixer(ours.input_layernorm(x)),
            lambda x: theirs_mixer(theirs.input_layernorm(x)),
        ),
        "moe": (lambda x: ours.mlp(ours.post_attention_layernorm(x))[0], theirs_moe),
    }


# ---------------------------------------------------------------------------------------------
# Parity, timing, parts


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def output_and_input_grad(branch, x: torch.Tensor, grad: torch.Tensor):
    x.grad = None
    out = branch(x)
    out.backward(grad)
    return out.detach(), x.grad


def check(layers: LayerPair, docs, x, grad, tolerance: float, name: str) -> dict:
    """Relative errors of transformers' residual branches against ours, output and input
    gradient of each; ParityError above `tolerance`."""
    errors = {}
    for branch, (ours_fn, theirs_fn) in residual_branches(layers, docs).items():
        want = output_and_input_grad(ours_fn, x, grad)
        got = output_and_input_grad(theirs_fn, x, grad)
        errors[f"{branch}_output"] = round(relative_error(got[0], want[0]), 5)
        errors[f"{branch}_input_grad"] = round(relative_error(got[1], want[1]), 5)
    if max(errors.values()) > tolerance:
        raise ParityError(
            f"{name} differs from ours by {errors} (relative; tolerance {tolerance}): the two "
            "layers do not compute the same function, so their times would not compare"
        )
    return errors


def inputs(tokens: int, dim: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, tokens, dim, device=device, dtype=torch.bfloat16, generator=g)
    grad = torch.randn(1, tokens, dim, device=device, dtype=torch.bfloat16, generator=g)
    return x.requires_grad_(), grad


def forward_backward(forward, x, grad, params) -> None:
    for p in params:
        p.grad = None
    x.grad = None
    forward(x).backward(grad)


def time_ms(step, device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def step_peak_gib(step, device) -> float | None:
    """The most memory one call allocates above what was held before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return round((torch.cuda.max_memory_allocated(device) - held) / GIB, 3)


@contextlib.contextmanager
def part_ranges(block: DecoderBlock):
    """A profiler range per part of the block's forward, opened and closed by module hooks and
    around `experts_swiglu`: the block's code is what runs, unchanged."""
    current: list = []

    def switch(part: str | None) -> None:
        if current:
            current.pop().__exit__(None, None, None)
        if part is not None:
            current.append(record_function(PART_RANGE + part).__enter__())

    mlp, handles = block.mlp, []

    def on(module, before: str | None, after: str | None = None, closing: bool = False) -> None:
        if before is not None:
            handles.append(module.register_forward_pre_hook(lambda *_: switch(before)))
        if after is not None or closing:
            handles.append(module.register_forward_hook(lambda *_: switch(after)))

    on(block.mixer, "mixer", closing=True)
    on(mlp.gate, "router", "permutation")
    on(mlp.shared_expert_gate, "shared_expert")
    on(mlp, None, closing=True)
    swiglu = moe.experts_swiglu

    def timed_swiglu(*args, **kwargs):
        switch("grouped_gemm")
        out = swiglu(*args, **kwargs)
        switch("combine")
        return out

    moe.experts_swiglu = timed_swiglu
    try:
        yield
    finally:
        moe.experts_swiglu = swiglu
        for handle in handles:
            handle.remove()
        switch(None)


def profiled_parts(block, step, device, steps: int) -> dict:
    """Per part, ms per call (GPU kernel time; op self time on CPU), and the GEMM kernels' ms
    inside the grouped-GEMM part."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with part_ranges(block), torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    return part_times_ms(prof.events(), cuda, steps)


def part_times_ms(events, cuda: bool, steps: int) -> dict:
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    chains = _Chains()
    part_of = range_owner(cpu_ops, chains, PART_RANGE)
    samples = _kernel_samples(events, cpu_ops) if cuda else _self_time_samples(cpu_ops)
    totals: dict[str, float] = defaultdict(float)
    gemm_us = 0.0
    for _, op, us in samples:
        chain = chains.of(op)
        part = part_of(chain) or "other"
        totals[part] += us
        if part == "grouped_gemm" and any(e.name in GEMM_OPS for e in chain):
            gemm_us += us
    return {
        "parts_ms": {p: round(totals[p] / steps / 1e3, 3) for p in PARTS},
        "grouped_gemm_kernels_ms": round(gemm_us / steps / 1e3, 3),
        "measure": "GPU kernel time" if cuda else "CPU self time",
    }


def grouped_gemm_tflops(args: Qwen35ModelArgs, tokens: int, gemm_ms: float) -> float | None:
    flops = 2 * tokens * args.num_experts_per_tok * 3 * args.moe_hidden_dim * args.dim * 3
    return float(f"{flops / (gemm_ms / 1e3) / 1e12:.3g}") if gemm_ms > 0 else None


# ---------------------------------------------------------------------------------------------


def _environment(device: torch.device, argv: list[str]) -> dict:
    """As the other benchmarks record it, with the command of these arguments (main's, which
    are the process's own unless a caller passes others)."""
    from benchmarks.common import one_device_environment

    command = f"python -m {MODULE} {shlex.join(argv)}"
    return {**one_device_environment(device, MODULE), "command": command}


def _transformers_record(implementations: list[str], device) -> dict:
    import transformers

    cuda = device.type == "cuda"
    fla = cuda and importlib.util.find_spec("fla") is not None
    causal_conv1d = cuda and importlib.util.find_spec("causal_conv1d") is not None
    return {
        "version": transformers.__version__,
        "experts_implementations": implementations,
        "attention": "sdpa",
        "delta_rule": "fla" if fla else "torch",
        "conv": "causal_conv1d" if causal_conv1d else "torch",
        "documents": "position_ids (RoPE, mask)"
        + (" and cu_seq_lens_q (delta rule)" if fla else "; the delta rule sees one sequence"),
    }


def measure_mixer(mixer: str, options, device, modeling, result: dict, measured: dict) -> None:
    """`measured` (this run's date and commit) goes into each entry: a resumed file holds
    entries of several runs."""
    checked = result["checks"].get(mixer)
    if checked is not None and not missing_points(result, mixer, options, candidates(checked)):
        return  # resumed, and the file holds every point of this mixer
    delta_rule = result["transformers"]["delta_rule"]
    layers = build_layers(layer_args(options.flavor, mixer), device, modeling, delta_rule)
    if options.compile_backend != "none":
        compile_moe_block(layers.ours, options.compile_backend)
    checks = result["checks"][mixer] = {}
    for implementation in result["transformers"]["experts_implementations"]:
        name = f"transformers_{implementation}"
        checks[name] = check_candidate(layers, implementation, options, device)
        print(f"check {mixer} {name}: {checks[name]}", flush=True)
    runnable = [name.removeprefix("transformers_") for name in candidates(checks)[1:]]
    for tokens, corpus in missing_points(result, mixer, options, candidates(checks)):
        # A point cut short is measured from its start, so that each transformers time is
        # over ours of the same run: what the file holds of it goes.
        result["results"] = [e for e in result["results"] if not _of(e, mixer, tokens, corpus)]
        for entry in measure_point(layers, tokens, corpus, runnable, options, device):
            _add(result, {**entry, "measured": measured}, options)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def candidates(checks: dict) -> list[str]:
    """Ours and the transformers implementations whose check ran (a string: this device
    cannot run it)."""
    return [OURS] + [name for name, errors in checks.items() if isinstance(errors, dict)]


def missing_points(result: dict, mixer: str, options, candidates: list[str]) -> list[tuple]:
    """The (tokens, corpus) points of `mixer` that `result` lacks a candidate of."""
    return [
        (tokens, corpus)
        for tokens in options.tokens
        for corpus in options.corpora
        if not set(candidates)
        <= {e["candidate"] for e in result["results"] if _of(e, mixer, tokens, corpus)}
    ]


def _of(entry: dict, mixer: str, tokens: int, corpus: str) -> bool:
    return (entry["mixer"], entry["tokens"], entry["corpus"]) == (mixer, tokens, corpus)


def check_candidate(layers: LayerPair, implementation: str, options, device) -> dict | str:
    """The check's errors; a string where this device cannot run the implementation."""
    args, tokens = layers.args, options.check_tokens
    lengths = [tokens]
    if args.layer_types[0] == FULL_ATTENTION:  # three documents; the GDN's one: see the top
        lengths = [tokens // 3, tokens - 2 * (tokens // 3), tokens // 3]
    docs = boundaries(lengths, args, device)
    x, grad = inputs(tokens, args.dim, device, seed=1)
    layers.config._experts_implementation = implementation
    name = f"transformers_{implementation}"
    try:
        return check(layers, docs, x, grad, options.tolerance, name)
    except ParityError:
        raise
    except Exception as error:  # an implementation this device cannot run
        return f"{type(error).__name__}: {str(error)[:200]}"


def measure_point(layers: LayerPair, tokens: int, corpus: str, implementations, options, device):
    """Ours, then each transformers implementation, on one row: their result entries."""
    lengths = row_lengths(corpus, tokens)
    docs = boundaries(lengths, layers.args, device)
    x, grad = inputs(tokens, layers.args.dim, device, seed=0)
    point = {
        "mixer": layers.args.layer_types[0],
        "tokens": tokens,
        "corpus": corpus,
        "documents": len(lengths),
    }
    step = functools.partial(
        forward_backward, ours_forward(layers, docs), x, grad, list(layers.ours.parameters())
    )
    ours_ms = time_ms(step, device, options.reps, options.warmup)
    parts = profiled_parts(layers.ours, step, device, options.profile_steps)
    gemm_ms = parts["grouped_gemm_kernels_ms"]
    yield {
        **point,
        "candidate": OURS,
        "ms": round(ours_ms, 3),
        "step_peak_gib": step_peak_gib(step, device),
        **parts,
        "grouped_gemm_tflops": grouped_gemm_tflops(layers.args, tokens, gemm_ms),
    }
    for implementation in implementations:
        layers.config._experts_implementation = implementation
        step = functools.partial(
            forward_backward,
            theirs_forward(layers, docs),
            x,
            grad,
            list(layers.theirs.parameters()),
        )
        entry = {**point, "candidate": f"transformers_{implementation}"}
        try:
            ms = time_ms(step, device, options.reps, options.warmup)
            entry.update(
                ms=round(ms, 3),
                step_peak_gib=step_peak_gib(step, device),
                over_ours=float(f"{ms / ours_ms:.4g}"),
            )
        except Exception as error:  # out of memory, most likely
            entry["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        yield entry


def _add(result: dict, entry: dict, options) -> None:
    result["results"].append(entry)
    shown = {k: v for k, v in entry.items() if k not in ("parts_ms", "measure", "measured")}
    print(" ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    if options.out:
        records.write_json(options.out, result)


COLUMNS = [
    ("mixer", "mixer"),
    ("tokens", "tokens"),
    ("corpus", "corpus"),
    ("documents", "docs"),
    ("candidate", "layer"),
    ("ms", "fwd+bwd ms"),
    ("step_peak_gib", "peak GiB"),
    ("over_ours", "/ ours"),
    *((f"parts_ms.{p}", p) for p in PARTS),
    ("grouped_gemm_tflops", "GEMM TFLOP/s"),
]


def print_table(result: dict) -> None:
    rows = []
    for entry in result["results"]:
        row = dict(entry)
        row["mixer"] = "GDN" if entry["mixer"] == LINEAR_ATTENTION else "attention"
        for part, ms in entry.get("parts_ms", {}).items():
            row[f"parts_ms.{part}"] = ms
        rows.append(row)
    records.print_table(rows, COLUMNS)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_args(argv)
    found = option_problems(options)
    if found:
        raise SystemExit("moe_layer: " + "; ".join(found))
    device = torch.device(options.device)
    implementations = options.transformers_experts or installed_experts_implementations()
    cuda = device.type == "cuda"
    if cuda:
        # FLA 0.6.0 refuses the gated backward on Hopper with Triton < 3.7.1; titan_gdn lifts
        # that for 128-wide tiles, and transformers calls the same FLA function.
        from titan_gdn.ops.delta_rule.hopper_guard import allow_fla_hopper_bk128

        allow_fla_hopper_bk128()
    # The trainer compiles for its one row length; here each length gets its own static graph,
    # not one graph generalised over lengths after the second.
    torch._dynamo.config.automatic_dynamic_shapes = False
    family = TRANSFORMERS_CLASSES[MOE][0]
    modeling = transformers_qwen3_5_module(torch_path=not cuda, family=family)
    flavor = qwen3_5_args[options.flavor]
    environment = _environment(device, argv)
    result = {
        "kind": "moe_layer",
        "environment": environment,
        "flavor": options.flavor,
        "shape": {
            "dim": flavor.dim,
            "num_experts": flavor.num_experts,
            "top_k": flavor.num_experts_per_tok,
            "moe_hidden_dim": flavor.moe_hidden_dim,
            "shared_expert_hidden_dim": flavor.shared_expert_hidden_dim,
        },
        "dtype": "bfloat16",
        "transformers": _transformers_record(implementations, device),
        "settings": {name: getattr(options, name) for name in RESUME_SETTINGS},
        "checks": {},
        "results": [],
    }
    previous = records.read_json(options.out) if options.resume else None
    if previous is not None:
        found = resume_problems(previous, result)
        if found:
            raise SystemExit("moe_layer: " + "; ".join(found))
        # The first invocation's environment stays; `commands` lists every one that added.
        result = {**previous, "checks": {**previous["checks"]}}
    records.add_command(result, environment["command"])
    measured = {"date": environment["date"], "git": environment["git"]}
    for mixer in options.mixers:
        measure_mixer(mixer, options, device, modeling, result, measured)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
