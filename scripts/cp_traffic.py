"""Bytes that context parallel moves per GPU, per layer and per training step, for each split of
the cp ranks (heads, states, heads x states), from the flavors' shapes; and the time those bytes
take on NVLink and on an inter-node link. Prints the tables of docs/context_parallel.md.

    python scripts/cp_traffic.py [--flavors 0.8B 2B ...] [--lengths 131072 ...]

Counted: what one GPU sends in forward and backward (no activation checkpointing; full
checkpointing sends the forward's again), bf16 activations, fp32 recurrent states.

- heads (Ulysses, one all-to-all each way per mixer): a rank keeps 1/h of its tokens' values
  and sends the rest: GDN q, k, v, a, b in and o out; attention q, k, v in (KV heads repeated
  up to h) and o out. Backward sends the same again.
- states (contiguous chunks, s ranks): GDN one all-gather of a [Dk, Dv + Dk] fp32 summary per
  value head (forward; the state gradients' the same in backward) and the conv's K - 1 tokens;
  attention an all-gather of K and V (forward) and a reduce-scatter of their gradients
  (backward). An all-gather sends a rank's part to the s - 1 others.
- heads x states: the heads exchange over h ranks of T / s tokens, then the states exchange of
  1/h of the heads over s ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_gdn.model import qwen3_5_args  # noqa: E402
from titan_gdn.model.args import LINEAR_ATTENTION  # noqa: E402

BF16, FP32 = 2, 4
NVLINK = 450e9  # bytes/s per GPU and direction, H200 NVLink 4
INTER_NODE = 50e9  # bytes/s per GPU, e.g. 400 Gb/s InfiniBand


def per_layer(args, seq_len: int, heads: int, states: int) -> dict[str, tuple[float, float]]:
    """{layer type: (bytes over the heads group, bytes over the states group)} one GPU sends
    in forward + backward of one layer."""
    tokens = seq_len / (heads * states)  # per GPU, before any exchange
    kept = (heads - 1) / heads
    key = args.linear_num_key_heads * args.linear_key_head_dim
    value = args.linear_num_value_heads * args.linear_value_head_dim
    gdn_heads = tokens * kept * BF16 * (2 * key + value + 2 * args.linear_num_value_heads + value)
    groups = max(args.n_kv_heads, heads)
    attn_heads = tokens * kept * BF16 * args.head_dim * (2 * args.n_heads + 2 * groups)
    value_heads = args.linear_num_value_heads / heads
    summary = value_heads * args.linear_key_head_dim
    summary *= args.linear_value_head_dim + args.linear_key_head_dim
    halo = (args.linear_conv_kernel_dim - 1) * (2 * key + value) / heads * BF16
    gdn_states = (states - 1) * summary * FP32 + halo if states > 1 else 0.0
    chunk_tokens = seq_len / states
    kv = 2 * groups / heads * args.head_dim * BF16 * chunk_tokens
    attn_states = (states - 1) * kv if states > 1 else 0.0
    # Backward moves the same bytes again (gradients of every exchange).
    return {
        LINEAR_ATTENTION: (2 * gdn_heads, 2 * gdn_states),
        "full_attention": (2 * attn_heads, 2 * attn_states),
    }


def per_step(args, seq_len: int, heads: int, states: int) -> tuple[float, float]:
    layers = per_layer(args, seq_len, heads, states)
    total_heads = sum(layers[t][0] for t in args.layer_types)
    total_states = sum(layers[t][1] for t in args.layer_types)
    return total_heads, total_states


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f}" if x < 2**30 else f"{x / 2**30:,.2f} Gi"


def _seconds(nbytes: float, off_node: float) -> float:
    """Time of `nbytes` of which the fraction `off_node` crosses to another node."""
    return nbytes * (off_node / INTER_NODE + (1 - off_node) / NVLINK)


def _off_node(heads: int, states: int, node: int) -> tuple[float, float]:
    """Fractions of a rank's peers in another node: in its heads group (neighbouring ranks)
    and in its states group (ranks `heads` apart)."""
    heads_off = max(heads - node, 0) / (heads - 1) if heads > 1 else 0.0
    same_node = max(1, node // heads) if heads <= node else 1
    states_off = (states - min(same_node, states)) / (states - 1) if states > 1 else 0.0
    return heads_off, states_off


def layer_table(flavors, seq_len: int, degree: int) -> list[str]:
    lines = [
        f"Per layer, one GPU, forward + backward, {seq_len // 1024}k tokens, cp = {degree} "
        "(MiB; Gi = GiB):",
        "",
        "| model | GDN, heads | GDN, states | attention, heads | attention, states |",
        "|---|---|---|---|---|",
    ]
    for name in flavors:
        args = qwen3_5_args[name]
        h = per_layer(args, seq_len, degree, 1)
        s = per_layer(args, seq_len, 1, degree)
        lines.append(
            f"| {name} | {_mb(h[LINEAR_ATTENTION][0])} | {_mb(s[LINEAR_ATTENTION][1])} | "
            f"{_mb(h['full_attention'][0])} | {_mb(s['full_attention'][1])} |"
        )
    return lines


def step_table(flavors, lengths, layouts, node: int = 8) -> list[str]:
    header = " | ".join(f"{label}" for label, _ in layouts)
    lines = [
        f"| model | tokens | {header} |",
        "|---|---|" + "---|" * len(layouts),
    ]
    for name in flavors:
        args = qwen3_5_args[name]
        for seq_len in lengths:
            cells = []
            for _, (heads, states) in layouts:
                if heads > 1 and _heads_problem(args, heads):
                    cells.append("heads do not split")
                    continue
                hb, sb = per_step(args, seq_len, heads, states)
                heads_off, states_off = _off_node(heads, states, node)
                ms = 1e3 * (_seconds(hb, heads_off) + _seconds(sb, states_off))
                cells.append(f"{_mb(hb + sb)}, {ms:,.1f} ms")
            lines.append(f"| {name} | {seq_len // 1024}k | " + " | ".join(cells) + " |")
    return lines


def _heads_problem(args, heads: int) -> bool:
    from titan_gdn.parallel.context_parallel import context_parallel_problems

    return bool(context_parallel_problems(args, heads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavors", nargs="+", default=["0.8B", "2B", "4B", "9B", "27B"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[131072, 262144, 1048576])
    options = parser.parse_args()
    print("\n".join(layer_table(options.flavors, 262144, 8)))
    print()
    print(
        "Per training step, one GPU, forward + backward: bytes (MiB; Gi = GiB) and the time "
        f"they take on the links (ms; NVLink {NVLINK / 1e9:.0f} GB/s inside a node of 8 GPUs, "
        f"{INTER_NODE / 1e9:.0f} GB/s between nodes), one node, cp = 8:"
    )
    print()
    one_node = [("heads 8", (8, 1)), ("states 8", (1, 8)), ("heads 4 x states 2", (4, 2))]
    print("\n".join(step_table(options.flavors, options.lengths, one_node)))
    print()
    print("Two nodes, cp = 16:")
    print()
    two_nodes = [("heads 16", (16, 1)), ("states 16", (1, 16)), ("heads 8 x states 2", (8, 2))]
    print("\n".join(step_table(options.flavors, options.lengths, two_nodes)))


if __name__ == "__main__":
    main()
