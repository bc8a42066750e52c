"""Host time per call of the GDN layer's custom ops, against the same function called directly.

A training step launches its kernels from the host; where the host is the bottleneck (short
rows, cp=2: docs/gpu_results.md, session 8) every microsecond per call counts. This times, at
a small shape where the device keeps up, the forward of the conv and delta-rule ops through
the dispatcher (`torch.ops.titan_gdn.*`: the path eager and compiled training take) and their
bodies called as plain Python functions, on the backends the device resolves (FLA on CUDA).
FLA's own per-call backend dispatch is off, as importing titan_gdn sets it, unless the run
sets `FLA_DISABLE_BACKEND_DISPATCH=0`; the table says which.

    python scripts/op_overhead.py --tokens 4096 --calls 200 --json op_overhead.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_gdn.ops import conv  # noqa: E402
from titan_gdn.ops.delta_rule import (  # noqa: E402
    _gated_delta_rule_torch,
    chunk_gated_delta_rule_torch,
    resolve_delta_rule_backend,
)
from titan_gdn.ops.delta_rule.fla_op import gated_delta_rule_fla  # noqa: E402

HEADS, HEAD_DIM, CONV_KERNEL = 8, 128, 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], object], calls: int, device: torch.device) -> dict:
    """Microseconds per call: until the last call returns (host) and until the device is done."""
    for _ in range(3):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    _sync(device)
    wall = time.perf_counter() - start
    return {"host_us": 1e6 * host / calls, "wall_us": 1e6 * wall / calls}


def cases(tokens: int, device: torch.device) -> dict[str, tuple[Callable, Callable]]:
    """name -> (through the dispatcher, the body called directly), on fresh random inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cu_seqlens = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32, device=device)
    channels = 3 * HEADS * HEAD_DIM
    x = torch.randn(1, tokens, channels, device=device, dtype=dtype)
    weight = torch.randn(channels, CONV_KERNEL, device=device, dtype=dtype)
    conv_backend = conv.resolve_conv_backend(device, None)
    q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in "qkv")
    g = -torch.rand(1, tokens, HEADS, device=device)
    beta = torch.rand(1, tokens, HEADS, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5
    rule = (q, k, v, g, beta, cu_seqlens, scale)
    if resolve_delta_rule_backend(device, None) == "fla":
        delta_rule = (
            lambda: gated_delta_rule_fla(*rule),
            lambda: gated_delta_rule_fla._init_fn(*rule),
        )
    else:
        delta_rule = (
            lambda: _gated_delta_rule_torch(*rule),
            lambda: chunk_gated_delta_rule_torch(*rule),
        )
    return {
        f"conv ({conv_backend})": (
            lambda: conv._causal_conv1d_silu_op(x, weight, cu_seqlens, conv_backend),
            lambda: conv._causal_conv1d_silu(x, weight, cu_seqlens, conv_backend),
        ),
        f"delta rule ({resolve_delta_rule_backend(device, None)})": delta_rule,
    }


def fla_dispatch_disabled() -> bool | None:
    try:
        import fla.backends
    except ImportError:
        return None
    return fla.backends._DISPATCH_DISABLED


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with torch.no_grad():
        for name, (op, body) in cases(args.tokens, device).items():
            through_op, direct = (
                time_calls(op, args.calls, device),
                time_calls(body, args.calls, device),
            )
            overhead = through_op["host_us"] - direct["host_us"]
            rows.append(
                {"case": name, "op": through_op, "body": direct, "op_overhead_us": overhead}
            )
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "tokens": args.tokens,
        "fla_backend_dispatch_disabled": fla_dispatch_disabled(),
        "rows": rows,
    }
    print(
        f"{result['device']}, {args.tokens} tokens; "
        f"FLA dispatch disabled: {result['fla_backend_dispatch_disabled']}"
    )
    print(
        f"{'case':<22} {'op host us':>11} {'body host us':>13} {'op - body':>10} {'op wall us':>11}"
    )
    for row in rows:
        print(
            f"{row['case']:<22} {row['op']['host_us']:>11.1f} {row['body']['host_us']:>13.1f} "
            f"{row['op_overhead_us']:>10.1f} {row['op']['wall_us']:>11.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
