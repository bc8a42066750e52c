"""Document-causal attention alone, forward + backward, at Qwen3.5's attention shape: each kernel
that could serve the attention layers, on rows of one, a few and many documents.

    python -m benchmarks.attention --out docs/results/attention_h200.json

A row of `--seq-len` tokens is cut into `--documents` documents at random places (one
document: the whole row). Each candidate runs q [1, H, T, D] against k, v [1, Hkv, T, D] in
bf16, then the backward of a fixed output gradient; the time is the median of `--reps` after
two warm-up calls. TFLOP/s counts document pairs only (a query and the keys of its own
document up to itself): 4 * H * D * pairs forward, 2.5 times that backward. Each candidate's
output and gradients are compared with the dense-mask reference on a short row first, so a
kernel that ignores the document boundaries shows as an error, not as a fast time.
`--long-document-tokens 2048 4096` also times the training path (titan_gdn) with documents of
at least that many tokens on cuDNN's kernel (`titan_gdn@2048`, ...): how the op's
`LONG_DOCUMENT_TOKENS` is chosen.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import records
from titan_gdn.boundaries import padded_cu_seqlens

MODULE = "benchmarks.attention"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["32768x1", "32768x16", "32768x600", "8192x1", "131072x1"],
        help="rows as TOKENSxDOCUMENTS",
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--candidates", nargs="+", default=None)
    parser.add_argument(
        "--long-document-tokens",
        type=int,
        nargs="+",
        default=[],
        help="also the training path with each of these LONG_DOCUMENT_TOKENS (titan_gdn@N)",
    )
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Candidates: each takes q [1, H, T, D], k, v [1, Hkv, T, D], the row's document boundaries, and
# returns the output [1, H, T, D] (autograd through it).


def _flex(q, k, v, rows):
    from titan_gdn.ops.attention import _compiled_flex_attention, document_causal_block_mask

    mask = rows.setdefault("block_mask", document_causal_block_mask(rows["document_ids"]))
    return _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def _sdpa(backend):
    def run(q, k, v, rows):
        if rows["documents"] != 1:
            raise NotImplementedError("causal sdpa serves rows of one document")
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


def _kv_per_query_head(q, k, v):
    """k, v [1, Hkv, T, D] repeated to q's H heads, for kernels without GQA."""
    groups = q.shape[1] // k.shape[1]
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def _per_document(backend):
    """One dense causal call per document, K/V repeated for their query heads: what a kernel
    without document boundaries (cuDNN's causal one, the training path's for rows of one
    document) gives at each document's length, its launches included."""

    def run(q, k, v, rows):
        k, v = _kv_per_query_head(q, k, v)
        bounds = rows["cu_seqlens"].tolist()
        with torch.nn.attention.sdpa_kernel(backend):
            outs = [
                F.scaled_dot_product_attention(
                    q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True
                )
                for a, b in itertools.pairwise(bounds)
            ]
        return torch.cat(outs, dim=2)

    return run


def _tokens_first(x):
    return x[0].transpose(0, 1)  # [T, H, D], a view


class _Varlen(torch.autograd.Function):
    """torch's flash (FA2) or cuDNN kernels over cu_seqlens, K/V heads as they are (GQA)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, kernel):
        if kernel == "flash":
            o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max_len, max_len, 0.0, True, False
            )
            ctx.extra = (rng, unused)
        else:
            out = torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False
            )
            o, lse = out[0], out[1]
            ctx.extra = (out[6], out[7])
        ctx.save_for_backward(q, k, v, o, lse, cu)
        ctx.max_len, ctx.kernel = max_len, kernel
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse, cu = ctx.saved_tensors
        n, grad = ctx.max_len, grad.contiguous()
        if ctx.kernel == "flash":
            rng, unused = ctx.extra
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                grad, q, k, v, o, lse, cu, cu, n, n, 0.0, True, rng, unused
            )
        else:
            seed, offset = ctx.extra
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
                grad, q, k, v, o, lse, seed, offset, None, cu, cu, n, n, 0.0, True
            )
        return dq, dk, dv, None, None, None


def _varlen(kernel, repeat_kv=False):
    def run(q, k, v, rows):
        if repeat_kv:
            k, v = _kv_per_query_head(q, k, v)
        q, k, v = (_tokens_first(x).contiguous() for x in (q, k, v))
        o = _Varlen.apply(q, k, v, rows["cu_seqlens"], rows["max_len"], kernel)
        return o.transpose(0, 1)[None]

    return run


def _fa4(q, k, v, rows):
    from flash_attn.cute import flash_attn_varlen_func

    q, k, v = (_tokens_first(x).contiguous() for x in (q, k, v))
    cu, n = rows["cu_seqlens"], rows["max_len"]
    o = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n, causal=True
    )
    o = o[0] if isinstance(o, tuple) else o
    return o.transpose(0, 1)[None]


def _titan_gdn(q, k, v, rows):
    """The training path: the varlen op as the attention layers call it (per step, the host
    reads the boundaries once and the op picks its kernel)."""
    from titan_gdn.ops.attention import document_causal_attention

    ids = rows["document_ids"]
    return document_causal_attention(q, k, v, ids, None, "varlen", 0, rows["padded_cu_seqlens"])


@contextlib.contextmanager
def _long_documents_from(tokens: int | None):
    """The training path with documents of at least `tokens` on cuDNN's kernel (None: as set),
    forward and backward."""
    from titan_gdn.ops import varlen_attention

    default = varlen_attention.LONG_DOCUMENT_TOKENS
    varlen_attention.LONG_DOCUMENT_TOKENS = tokens or default
    try:
        yield
    finally:
        varlen_attention.LONG_DOCUMENT_TOKENS = default


def candidates() -> dict:
    from torch.nn.attention import SDPBackend

    return {
        "titan_gdn": _titan_gdn,
        "flex": _flex,
        "sdpa": _sdpa(
            [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        ),
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn_per_document": _per_document(SDPBackend.CUDNN_ATTENTION),
        "varlen_flash": _varlen("flash"),
        "varlen_cudnn": _varlen("cudnn"),
        "varlen_cudnn_kv_repeated": _varlen("cudnn", repeat_kv=True),
        "varlen_fa4": _fa4,
    }


# ---------------------------------------------------------------------------------------------


def make_rows(tokens: int, documents: int, device) -> dict:
    g = torch.Generator().manual_seed(tokens + documents)
    cuts = torch.randperm(tokens - 1, generator=g)[: documents - 1].add(1).sort().values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    lengths = bounds.diff()
    document_ids = torch.repeat_interleave(torch.arange(documents), lengths)[None]
    starts = torch.zeros(1, tokens, dtype=torch.bool)
    starts[0, bounds[:-1]] = True
    return {
        "padded_cu_seqlens": padded_cu_seqlens(starts).to(device),
        "documents": documents,
        "document_ids": document_ids.to(device, torch.int32),
        "cu_seqlens": bounds.to(device, torch.int32),
        "max_len": int(lengths.max()),
        "pairs": float((lengths.double() * (lengths.double() + 1) / 2).sum()),
    }


def _inputs(tokens, args, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(heads):
        return torch.randn(
            1, heads, tokens, args.head_dim, device=device, dtype=torch.bfloat16, generator=g
        ).requires_grad_()

    return (
        randn(args.heads),
        randn(args.kv_heads),
        randn(args.kv_heads),
        torch.randn(
            1, args.heads, tokens, args.head_dim, device=device, dtype=torch.bfloat16, generator=g
        ),
    )


def _reference(q, k, v, rows):
    ids = rows["document_ids"][0]
    n = ids.numel()
    mask = (ids[:, None] == ids[None, :]) & torch.ones(
        n, n, dtype=torch.bool, device=ids.device
    ).tril()
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
    )


def check(fn, args, device) -> float:
    """The largest relative error of output and gradients against the fp32 dense-mask
    reference, on a 2048-token row of 5 documents."""
    q, k, v, grad = _inputs(2048, args, device, seed=1)
    rows = make_rows(2048, 5, device)
    try:
        fn(q, k, v, rows)
    except NotImplementedError:  # a kernel for rows of one document
        rows = make_rows(2048, 1, device)
    errors = []
    outs = []
    for f in (fn, _reference):
        for x in (q, k, v):
            x.grad = None
        o = f(q, k, v, rows)
        o.backward(grad.to(o.dtype))
        outs.append([o.detach().float(), *(x.grad.float() for x in (q, k, v))])
    for got, want in zip(*outs, strict=True):
        errors.append(((got - want).norm() / want.norm()).item())
    return max(errors)


def time_ms(fn, q, k, v, grad, rows, reps: int) -> float:
    def step():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v, rows).backward(grad)

    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _environment() -> dict:
    from benchmarks.common import one_device_environment

    return one_device_environment(torch.device("cuda"), MODULE)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda")
    chosen = {
        n: f for n, f in candidates().items() if args.candidates is None or n in args.candidates
    }
    chosen |= {f"titan_gdn@{n}": _titan_gdn for n in args.long_document_tokens}
    thresholds = {f"titan_gdn@{n}": n for n in args.long_document_tokens}
    result = {
        "kind": "attention",
        "environment": _environment(),
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "checks": {},
        "results": [],
    }
    for name, fn in chosen.items():
        try:
            with _long_documents_from(thresholds.get(name)):
                result["checks"][name] = check(fn, args, device)
        except Exception as error:  # a candidate this machine lacks
            result["checks"][name] = f"{type(error).__name__}: {str(error)[:160]}"
        print(f"check {name}: {result['checks'][name]}", flush=True)
    for layout in args.layouts:
        tokens, documents = (int(x) for x in layout.split("x"))
        rows = make_rows(tokens, documents, device)
        q, k, v, grad = _inputs(tokens, args, device)
        flops = 4 * args.heads * args.head_dim * rows["pairs"] * 3.5
        for name, fn in chosen.items():
            if not isinstance(result["checks"][name], float) or result["checks"][name] > 2e-2:
                continue
            try:
                with _long_documents_from(thresholds.get(name)):
                    ms = time_ms(fn, q, k, v, grad, rows, args.reps)
            except NotImplementedError:
                continue
            except Exception as error:
                print(f"{layout} {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            entry = {
                "tokens": tokens,
                "documents": documents,
                "candidate": name,
                "ms": round(ms, 3),
                "tflops": round(flops / ms / 1e9, 1),
            }
            result["results"].append(entry)
            print(
                f"{layout:>10} {name:<26} {ms:9.2f} ms {entry['tflops']:7.1f} TFLOP/s", flush=True
            )
        rows.pop("block_mask", None)
        del q, k, v, grad
        torch.cuda.empty_cache()
    if args.out:
        records.write_json(args.out, result)


if __name__ == "__main__":
    main()
