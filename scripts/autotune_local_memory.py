"""How much device memory FLA's autotuning leaves reserved as local memory, and whether
resetting the CUDA stack limit gives it back.

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/autotune_local_memory.py [--tokens 32768]

Run with an empty Triton cache, or nothing is tuned. One forward + backward of the FLA delta
rule at the per-rank shape of the 0.8B / 2B flavors at cp=2 (8 heads of 128), packed documents;
the memory held outside PyTorch's caching allocator and the CUDA stack limit are printed
before, after, and after the stack limit is set back to its default. titan_gdn's ops do that
reset themselves after a first use (`titan_gdn.ops.local_memory`); this script calls FLA
through them with that reset disabled, to see what tuning alone leaves behind.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from titan_gdn.ops import local_memory
from titan_gdn.ops.delta_rule import fla_op, gated_delta_rule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    driver = local_memory._cuda_driver()
    fla_op.release_after_first_use = lambda *tensors: None  # to see what tuning leaves
    torch.zeros(1, device="cuda")

    def reading(after: str, seconds: float | None = None) -> tuple:
        gib = round(local_memory.outside_allocator_gib(), 3)
        return after, gib, local_memory.stack_limit(driver), seconds

    rows = [reading("start")]
    tokens, heads, dim = args.tokens, args.heads, 128
    ends = [0, 1000, 5000, min(30000, tokens - 1), tokens]
    cu_seqlens = torch.tensor(ends, dtype=torch.int32, device="cuda")

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = (bf16(1, tokens, heads, dim) for _ in range(3))
    g = (-torch.rand(1, tokens, heads, device="cuda")).requires_grad_()
    beta = torch.rand(1, tokens, heads, device="cuda", dtype=torch.bfloat16).requires_grad_()
    start = time.perf_counter()
    gated_delta_rule(q, k, v, g, beta, cu_seqlens, backend="fla").float().sum().backward()
    seconds = round(time.perf_counter() - start, 1)
    rows.append(reading("delta rule forward + backward", seconds))
    reset = local_memory.reset_stack_limit(driver)
    rows.append(reading(f"stack limit reset (was {reset})"))
    print(f"{'after':<36} {'outside allocator GiB':>22} {'stack B/thread':>15} {'s':>6}")
    for name, gib, stack, secs in rows:
        print(f"{name:<36} {gib:>22.3f} {stack:>15} {secs if secs is not None else '':>6}")
    if args.json:
        keys = ("after", "outside_allocator_gib", "stack_bytes_per_thread", "seconds")
        with open(args.json, "w") as f:
            json.dump(
                {"options": vars(args), "rows": [dict(zip(keys, r, strict=True)) for r in rows]},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
