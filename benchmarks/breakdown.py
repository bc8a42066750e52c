"""Where one training step's time goes, from a torch.profiler trace of that step.

Each GPU kernel (on CPU: each op's self time) is put in one category by its name and by the
ops that launched it: the kernels of the delta-rule and conv custom ops wherever they run
(forward, backward, recompute), flex attention, GEMMs, the chunked loss, the mixers'
all-to-alls, FSDP's collectives and copies, the optimizer (with gradient clipping), document
boundaries, and everything else (norms, gates, layout copies). Kernels on different streams
overlap, so categories can sum to more than the step; `busy_ms` is the time any kernel runs,
`exposed_comm_ms` per kind of collective the time it runs with no compute kernel beside it.

Blocks are told apart by a profiler range around each block's forward (`layer_ranges`); a
backward node carries the sequence number of the forward op that made it, which maps backward
(and recompute) time to its block too.
"""

from __future__ import annotations

import bisect
import contextlib
import re
import statistics
from collections import defaultdict

from torch.autograd import DeviceType
from torch.autograd.profiler import record_function

from benchmarks.intervals import length, merged, uncovered
from benchmarks.trace_events import STEP_PHASES

CATEGORIES = (
    "delta_rule",
    "conv",
    "attention",
    "gemm",
    "loss",
    "all_to_all",
    "fsdp",
    "optimizer",
    "documents",
    "other",
)
LAYER_RANGE = "bench::layer "
# Collective ops as the profiler names them (functional, c10d, DTensor's, the backends'),
# without helpers such as wait_tensor.
_COLLECTIVE_OPS = (
    "_c10d_functional::",
    "c10d::",
    "_dtensor::",
    "nccl:",
    "gloo:",
)
_COLLECTIVE_VERBS = (
    "all_to_all",
    "alltoall",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "all_reduce",
    "allreduce",
)

# (category, substrings of a kernel's name, substrings of an enclosing op's name). The first
# rule that matches wins: step phases come before the kernels they contain, so a GEMM inside
# the loss is loss time and the all-reduce of gradient clipping optimizer time. What is left of
# the collectives then are the mixers' head redistributions (_dtensor::shard_dim_alltoall).
_RULES = (
    ("fsdp", ("AllGather", "ReduceScatter"), ("FSDP::",)),
    ("optimizer", (), ("Optimizer.", "bench::clip_grad_norm")),
    ("all_to_all", ("SendRecv", "AllToAll"), _COLLECTIVE_OPS),
    ("documents", (), ("bench::documents",)),
    ("delta_rule", ("gated_delta_rule",), ("gated_delta_rule",)),
    ("conv", ("causal_conv1d",), ("causal_conv1d",)),
    # Inductor names a template kernel after its origin ("triton_tem_fused_flex_attention_0");
    # flex attention is the only template in these graphs (GEMMs stay cuBLAS calls unless
    # max-autotune is on), so any template kernel is attention.
    (
        "attention",
        ("flex_attention", "triton_tem_", "fmha", "flash_fwd", "flash_bwd"),
        ("flex_attention", "scaled_dot_product"),
    ),
    ("loss", (), ("bench::loss", "ChunkedLinearCrossEntropy")),
    (
        "gemm",
        ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitK"),
        (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::matmul",
            "aten::linear",
            "aten::_grouped_mm",
        ),
    ),
)


OTHER_KERNELS = 10  # the largest uncategorized kernels a breakdown lists by name
OTHER_NAME_CHARS = 100


def categorize(kernel_name: str, op_names: list[str]) -> str:
    for category, kernel_parts, op_parts in _RULES:
        if any(part in kernel_name for part in kernel_parts):
            return category
        if any(part in name for name in op_names for part in op_parts):
            return category
    return "other"


@contextlib.contextmanager
def layer_ranges(model):
    """A profiler range "bench::layer i" around the forward of each block of `model`.

    The hooks sit on the (compiled) block modules, outside the compiled code, so they neither
    break nor recompile a graph; eager blocks get them the same way.
    """
    handles, open_ranges = [], []
    for index, block in enumerate(model.layers.values()):

        def enter(module, args, index=index):
            open_ranges.append(record_function(f"{LAYER_RANGE}{index}").__enter__())

        def leave(module, args, output):
            open_ranges.pop().__exit__(None, None, None)

        handles.append(block.register_forward_pre_hook(enter))
        handles.append(block.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def step_breakdown(
    events, layer_types: list[str], cuda: bool, exchanges: list[list] | None = None
) -> dict:
    """Category totals (ms) of one profiled step, per block type, and its all-to-alls.

    `exchanges`: per rank of this rank's cp group, this one first, its `exchange_kernels`;
    with them each all-to-all is also timed from the last rank's arrival to the last rank's
    end: the exchange itself, without the time a rank's kernel waits for its peers."""
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    chains = _Chains()
    layer_of = _layer_index(cpu_ops, chains)
    collectives = _mixer_collectives(cpu_ops, chains, layer_of)
    samples = _kernel_samples(events, cpu_ops) if cuda else _self_time_samples(cpu_ops)
    totals: dict[str, float] = defaultdict(float)
    per_type: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    collective_us: dict[int, float] = defaultdict(float)
    other_us: dict[str, float] = defaultdict(float)
    for kernel_name, op, us in samples:
        chain = chains.of(op)
        category = categorize(kernel_name, [e.name for e in chain])
        totals[category] += us
        if category == "other":
            other_us[kernel_name[:OTHER_NAME_CHARS]] += us
        layer = layer_of(chain)
        if layer is not None:
            per_type[layer_types[layer]][category] += us
        owner = next((e for e in chain if id(e) in collectives), None)
        if owner is not None:
            collective_us[id(owner)] += us
    result = {
        "measure": "GPU kernel time" if cuda else "CPU self time",
        "categories_ms": _ms(totals),
        "layers_ms": {kind: _ms(values) for kind, values in per_type.items()},
        # What no rule names, largest first: where a new category or rule is due.
        "other_kernels_ms": {
            name: round(us / 1000, 3)
            for name, us in sorted(other_us.items(), key=lambda item: -item[1])[:OTHER_KERNELS]
        },
        "all_to_all": _all_to_all_summary(
            collectives, collective_us, chains, len(layer_types), cuda, exchanges
        ),
    }
    if cuda:
        result["busy_ms"] = round(_union_us(events) / 1000, 3)
        result["exposed_comm_ms"] = _exposed_comm_ms(events)
    result["host_syncs"] = _host_syncs(cpu_ops, chains, cuda)
    return result


def _ms(values: dict[str, float]) -> dict[str, float]:
    return {name: round(values.get(name, 0.0) / 1000, 3) for name in CATEGORIES}


class _Chains:
    """An op and its enclosing ops, innermost first (memoized: traces have 10^4-10^5 ops)."""

    def __init__(self):
        self._memo: dict[int, list] = {}

    def of(self, op) -> list:
        if op is None:
            return []
        key = id(op)
        if key not in self._memo:
            self._memo[key] = [op, *self.of(op.cpu_parent)]
        return self._memo[key]


# Where the host waits for the device: CUDA's synchronizing calls, and the op behind
# `.item()` / `int(tensor)` (which also names the wait on CPU, where there is no CUDA call).
_CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_VALUE_READ = "aten::_local_scalar_dense"
_SYNCS = (*_CUDA_SYNCS, _VALUE_READ)


def _host_syncs(cpu_ops, chains: _Chains, cuda: bool) -> dict:
    """Host syncs in the step by phase, and the ops that cause the most of them. In a CUDA
    profile a value read counts only with a synchronizing call inside it: reading a host
    tensor's value (the boundaries the host already holds) waits for nothing."""
    waiting = {id(e) for op in cpu_ops if op.name in _CUDA_SYNCS for e in chains.of(op)}
    by_phase: dict[str, int] = defaultdict(int)
    causes: dict[str, int] = defaultdict(int)
    for op in cpu_ops:
        chain = chains.of(op)
        if op.name not in _SYNCS or any(e.name in _SYNCS for e in chain[1:]):
            continue
        if cuda and op.name == _VALUE_READ and id(op) not in waiting:
            continue
        by_phase[_phase(chain)] += 1
        cause = next((e.name for e in chain[1:] if not e.name.startswith("bench::")), "step")
        causes[cause] += 1
    top = sorted(causes.items(), key=lambda item: -item[1])[:5]
    return {"total": sum(by_phase.values()), "by_phase": dict(by_phase), "top_causes": dict(top)}


def _phase(chain) -> str:
    if _in_backward(chain):
        return "backward"
    names = [e.name for e in chain]
    phase = next((p for p in STEP_PHASES if p in names), None)
    if phase is None:
        return "optimizer" if any(n.startswith("Optimizer.") for n in names) else "other"
    return phase.removeprefix("bench::")


def _layer_index(cpu_ops, chains: _Chains):
    """A function from an op chain to its block index (None outside blocks)."""
    return range_owner(cpu_ops, chains, LAYER_RANGE, int)


def range_owner(cpu_ops, chains: _Chains, prefix: str, label=str):
    """A function from an op chain to the profiler range (named `prefix` + label) it belongs
    to: the range around it in forward; in backward, the range of the forward op whose
    autograd node it runs (the node's sequence number); None outside every range."""
    ranges = {id(e): label(e.name[len(prefix) :]) for e in cpu_ops if e.name.startswith(prefix)}

    def forward_range(chain):
        return next((ranges[id(e)] for e in chain if id(e) in ranges), None)

    by_sequence = {}
    for op in cpu_ops:
        chain = chains.of(op)
        if op.sequence_nr >= 0 and not _in_backward(chain):
            owner = forward_range(chain)
            if owner is not None:
                by_sequence.setdefault(op.sequence_nr, owner)

    def owner_of(chain):
        for e in chain:
            if id(e) in ranges:
                return ranges[id(e)]
            # The engine's event and the node's own both carry the node's sequence number.
            backward = _in_backward([e]) or "Backward" in e.name
            if backward and e.sequence_nr in by_sequence:
                return by_sequence[e.sequence_nr]
        return None

    return owner_of


def _in_backward(chain) -> bool:
    # On CUDA the autograd engine runs backward on its own thread, on CPU on the caller's:
    # the enclosing engine events, not the thread, tell the two apart.
    return any(e.name.startswith("autograd::engine::evaluate_function") for e in chain)


def _mixer_collectives(cpu_ops, chains: _Chains, layer_of) -> dict[int, object]:
    """The outermost collective ops inside blocks, FSDP's excepted: the head redistributions
    of the mixers (to heads and back, in forward, backward and recompute)."""
    found = {}
    for op in cpu_ops:
        chain = chains.of(op)
        if not _is_collective(op.name) or any(_is_collective(e.name) for e in chain[1:]):
            continue
        if layer_of(chain) is not None and not any("FSDP::" in e.name for e in chain):
            found[id(op)] = op
    return found


def _is_collective(name: str) -> bool:
    return name.startswith(_COLLECTIVE_OPS) and any(verb in name for verb in _COLLECTIVE_VERBS)


def _kernel_samples(events, cpu_ops):
    """(name, launching op, us) for each kernel, copy and memset on the device, once each."""
    # A device event's `linked_correlation_id` is the `id` of the op that launched it, but the
    # CUDA API calls among the CPU events have ids from CUPTI's own count, which collide with
    # the ops' (and torch 2.11 keeps no such link on the event): read torch's own association,
    # each op's `kernels`. Those lists name no event, only (name, duration), and where ids
    # collide an op's list also holds kernels that another op launched. So each device event
    # is claimed once: ops in time order, each takes the earliest unclaimed event of its
    # kernel's name and duration that starts after the op does (work runs after its launch).
    unclaimed = defaultdict(list)
    for e in sorted(device_work(events), key=lambda e: e.time_range.start):
        unclaimed[e.name, e.time_range.elapsed_us()].append(e.time_range.start)
    for op in sorted(cpu_ops, key=lambda op: op.time_range.start):
        if _launches_kernels(op):
            for kernel in op.kernels:
                starts = unclaimed.get((kernel.name, kernel.duration), [])
                first = bisect.bisect_left(starts, op.time_range.start)
                if first < len(starts):
                    del starts[first]
                    yield kernel.name, op, kernel.duration
    # Work launched outside any op is in no list: what is left over counts by its name alone.
    for (name, us), starts in unclaimed.items():
        for _ in starts:
            yield name, None, us


# CUDA runtime and driver calls (cudaLaunchKernel, cuLaunchKernelEx, cudaStreamWaitEvent).
_CUDA_API = re.compile(r"cu(da)?[A-Z]")


def _launches_kernels(op) -> bool:
    # Torch links nothing to async ops. A legacy op's one kernel is its own CUDA time, its
    # children's included. Kernels link to the ops inside a profiler range, never to the range,
    # whose list can only hold its own span on the device. And torch also fills the list of a
    # CUDA call that it links to no op, with the kernels of the op whose id the call's id equals.
    return not (op.is_async or op.is_legacy or op.is_user_annotation or _CUDA_API.match(op.name))


def device_work(events):
    # A profiler range's span on the device runs from its first kernel to its last, gaps too.
    return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def _self_time_samples(cpu_ops):
    for op in cpu_ops:
        yield "", op, op.self_cpu_time_total


def _union_us(events) -> float:
    return length(_merged(device_work(events)))


# NCCL's kernels by what they run; any other device work is compute (copies included).
_COMM_KERNELS = {
    "fsdp": ("AllGather", "ReduceScatter"),
    "all_to_all": ("SendRecv", "AllToAll"),
    "all_reduce": ("AllReduce",),
}


def _exposed_comm_ms(events) -> dict[str, float]:
    """Per kind of collective, the time its kernels run while no compute kernel does: where
    the step waits on the link (or on a peer), not time the collective hides behind work."""
    work = device_work(events)
    compute = _merged([e for e in work if not e.name.startswith("nccl")])
    exposed = {}
    for kind, parts in _COMM_KERNELS.items():
        comm = _merged([e for e in work if any(p in e.name for p in parts)])
        alone = [part for stretch in comm for part in uncovered(compute, *stretch)]
        exposed[kind] = round(length(alone) / 1000, 3)
    return exposed


def _merged(events) -> list[tuple[float, float]]:
    return merged((e.time_range.start, e.time_range.end) for e in events)


def exchange_kernels(events, trace_start_us: float) -> list[tuple[float, float]]:
    """(start, end) of each all-to-all kernel of the step in order, in wall-clock us (the
    ranks of one host share that clock): what a rank tells rank 0 for `step_breakdown`."""
    kernels = [e for e in device_work(events) if any(p in e.name for p in _EXCHANGE_KERNELS)]
    return sorted(
        (trace_start_us + k.time_range.start, trace_start_us + k.time_range.end) for k in kernels
    )


_EXCHANGE_KERNELS = ("SendRecv", "AllToAll")


def _exchange_times(ops: list, exchanges: list[list] | None) -> dict[int, tuple[float, ...]]:
    """Per collective op (by id), in us: its all-to-all kernel's time on this rank, the
    exchange's time from the last rank's start to the last rank's end, and the spread of the
    ranks' ends (near 0 when the clocks agree: an exchange ends on all ranks at once).
    Empty unless every rank ran one such kernel per op: the i-th op (by launch) is the i-th
    kernel on every rank."""
    if not exchanges or any(len(kernels) != len(ops) for kernels in exchanges):
        return {}
    times = {}
    for index, op in enumerate(sorted(ops, key=lambda op: op.time_range.start)):
        starts, ends = zip(*(kernels[index] for kernels in exchanges), strict=True)
        own_start, own_end = exchanges[0][index]
        exchange = max(0.0, max(ends) - max(starts))
        times[id(op)] = (own_end - own_start, exchange, max(ends) - min(ends))
    return times


def _all_to_all_summary(
    collectives: dict,
    kernel_us: dict,
    chains: _Chains,
    mixers: int,
    cuda: bool,
    exchanges: list[list] | None = None,
) -> dict:
    """Calls per mixer and direction, and per message size the time and bandwidth (GPU):
    of the op's kernels (the all-to-all, and any copy it makes), and where every rank's
    kernels are given, of the all-to-all kernel alone and of the exchange itself."""
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    exchange_groups: dict[tuple[str, int], list[tuple[float, ...]]] = defaultdict(list)
    timed = _exchange_times(list(collectives.values()), exchanges)
    for key, op in collectives.items():
        direction = "backward" if _in_backward(chains.of(op)) else "forward"
        group = (direction, _message_bytes(op))
        groups[group].append(kernel_us.get(key, 0.0))
        if key in timed:
            exchange_groups[group].append(timed[key])
    calls = defaultdict(int)
    ops = defaultdict(int)
    for op in collectives.values():
        ops[op.name] += 1
    sizes = []
    for (direction, size), times in sorted(groups.items()):
        calls[direction] += len(times)
        entry = {"direction": direction, "bytes": size, "calls": len(times)}
        if cuda and size:
            kernel_ms = statistics.median(times) / 1000
            entry["median_kernel_ms"] = round(kernel_ms, 4)
            entry["gb_per_s"] = round(size / kernel_ms / 1e6, 2) if kernel_ms else None
        if exchange_groups.get((direction, size)):
            own, exchange, _ = zip(*exchange_groups[(direction, size)], strict=True)
            exchange_ms = statistics.median(exchange) / 1000
            entry["median_nccl_kernel_ms"] = round(statistics.median(own) / 1000, 4)
            entry["median_exchange_ms"] = round(exchange_ms, 4)
            entry["exchange_gb_per_s"] = round(size / exchange_ms / 1e6, 2) if exchange_ms else None
        sizes.append(entry)
    return {
        "mixers": mixers,
        "forward_calls": calls["forward"],
        "backward_calls": calls["backward"],
        "forward_per_mixer": round(calls["forward"] / mixers, 2),
        "backward_per_mixer": round(calls["backward"] / mixers, 2),
        "ops": dict(ops),
        "sizes": sizes,
        **_exchange_coverage(timed, exchanges),
    }


def _exchange_coverage(timed: dict, exchanges: list[list] | None) -> dict:
    if not exchanges:
        return {}
    if not timed:
        counts = [len(kernels) for kernels in exchanges]
        return {"exchange_ranks": len(exchanges), "exchange_unmatched_kernel_counts": counts}
    spreads = [spread for _, _, spread in timed.values()]
    return {
        "exchange_ranks": len(exchanges),
        "exchange_end_spread_us_median": round(statistics.median(spreads), 1),
    }


def _message_bytes(op) -> int:
    """Bytes this rank sends: the input tensor of the all-to-all."""
    shapes = op.input_shapes or []
    shape = next((s for s in shapes if isinstance(s, list | tuple) and s), None)
    if shape is None:
        return 0
    numel = 1
    for n in shape:
        numel *= n
    dtypes = getattr(op, "input_dtypes", None) or [""]
    return numel * _element_size(str(dtypes[0]).lower())


def _element_size(dtype: str) -> int:
    if "double" in dtype or "int64" in dtype or "long" in dtype:
        return 8
    if dtype in ("float", "float32", "int", "int32") or dtype.endswith("::float"):
        return 4
    return 2  # bf16 activations, also when the trace records no dtypes
