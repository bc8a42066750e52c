"""What building the document-causal flex BlockMask costs per step, by sequence length:
titan_gdn's construction from document spans against compiled `create_block_mask`, which
evaluates the mask at every token pair.

    python scripts/block_mask_cost.py --seq-lens 32768 65536 131072 [--json out.json]

Rows of the bundled corpus's document lengths are not needed: documents of 100-20,000 tokens
(uniform) are drawn, one row; every cp rank builds the whole row's mask. Median of `--repeats`
after one warm-up call (which compiles). `--skip-reference-above N` leaves out
`create_block_mask` past N tokens, where it takes long.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from titan_gdn.ops.attention import document_causal_block_mask, document_causal_mask_mod


def document_ids(seq_len: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(int(torch.randint(100, 20001, (1,), generator=gen)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:seq_len].to(torch.int32)[None].to(device)


def reference_block_mask(ids: torch.Tensor):
    seq_len = ids.shape[1]
    mask_mod = document_causal_mask_mod(ids)
    return _compiled_create_block_mask(mask_mod, 1, None, seq_len, seq_len, ids.device)


_compiled_create_block_mask = torch.compile(create_block_mask)


def seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-reference-above", type=int, default=None)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    print(f"{'seq_len':>10} {'from spans (s)':>15} {'create_block_mask (s)':>22} {'ratio':>8}")
    for seq_len in args.seq_lens:
        ids = document_ids(seq_len, device)
        ours = seconds(lambda ids=ids: document_causal_block_mask(ids), args.repeats)
        skip = args.skip_reference_above is not None and seq_len > args.skip_reference_above
        theirs = None if skip else seconds(lambda ids=ids: reference_block_mask(ids), args.repeats)
        ratio = None if theirs is None else theirs / ours
        rows.append({"seq_len": seq_len, "from_spans_s": ours, "create_block_mask_s": theirs})
        theirs_text = "-" if theirs is None else f"{theirs:.4f}"
        ratio_text = "-" if ratio is None else f"{ratio:.1f}x"
        print(f"{seq_len:>10} {ours:>15.4f} {theirs_text:>22} {ratio_text:>8}", flush=True)
    if args.json:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
