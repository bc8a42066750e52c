"""Pick the GDN conv backend by measurement: `fla` (FLA's Triton forward and our Triton backward,
`titan_gdn.ops.conv_backward`: what the model runs), `fla-own-backward` (FLA's conv end to end,
its autograd: forward, then a forward recompute and its backward kernel), causal-conv1d's CUDA
kernel, and the torch formulation compiled by inductor on its own (`torch-compiled`: what the
conv would cost if compiled blocks traced it instead of calling the opaque op; no model backend
runs it so). `--tilings` also times the backward alone: FLA's, and ours at several tile sizes.

    python -m benchmarks.conv_backends [--json out.json] [--backends fla ...] [--tilings]

On a packed row of random documents at the conv width of the 0.8B/2B (6144 channels: q, k, v)
and 4B (8192) flavors, each available backend's bf16 output and gradients are checked against
the fp32 torch reference, then forward + backward is timed (median of 20, CUDA events).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics

import torch

from titan_gdn.boundaries import documents_and_chunks
from titan_gdn.ops import conv, conv_backward
from titan_gdn.ops.conv import causal_conv1d_silu

CHANNELS = (6144, 8192)
LENGTHS = (8192, 32768, 131072)


def _cu_seqlens(length: int, gen: torch.Generator) -> torch.Tensor:
    ends = torch.randint(1, length, (length // 1000,), generator=gen)
    return torch.cat([torch.tensor([0]), ends, torch.tensor([length])]).unique()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# The taps traced into one graph, which inductor fuses into elementwise and reduction kernels.
_COMPILED_TORCH = torch.compile(conv._causal_conv1d_torch, fullgraph=True)


def _conv(backend, x, w, cu):
    if backend == "torch-compiled":
        return _COMPILED_TORCH(x, w, cu)
    if backend == "fla-own-backward":
        from fla.modules.causal_conv1d import causal_conv1d

        return causal_conv1d(x, weight=w, activation="silu", backend="triton", cu_seqlens=cu)[0]
    return causal_conv1d_silu(x, w, cu, backend)


def _run(backend, x, w, cu, grad, dtype):
    xs, ws = (t.detach().to(dtype).requires_grad_() for t in (x, w))
    out = _conv(backend, xs, ws, cu)
    out.backward(grad.to(dtype))
    return out, xs.grad, ws.grad


def _median_ms(run) -> float:
    """Median of 20 CUDA-event timings of `run()`, after 5 untimed calls."""
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


def _fwd_bwd_ms(backend, x, w, cu, grad) -> float:
    xs, ws = (t.detach().to(torch.bfloat16).requires_grad_() for t in (x, w))
    grad = grad.to(torch.bfloat16)
    return _median_ms(lambda: _conv(backend, xs, ws, cu).backward(grad))


def _fla_backward(grad, x, w, cu):
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

    cu, chunk_indices = documents_and_chunks(cu)
    kwargs = dict(dht=None, weight=w, activation="silu", cu_seqlens=cu, chunk_indices=chunk_indices)
    return causal_conv1d_bwd(x=x, dy=grad, **kwargs)[:2]


def _backward_ms(x, w, cu, grad, tiling) -> float:
    """Our backward alone at `tiling`, or FLA's (its recompute + backward kernels) for None."""
    x, w, grad = (t.to(torch.bfloat16) for t in (x, w, grad))
    if tiling is None:
        return _median_ms(lambda: _fla_backward(grad, x, w, cu))
    return _median_ms(lambda: conv_backward.causal_conv1d_silu_backward(grad, x, w, cu, *tiling))


# (rows per chunk, channels per program, warps): the arguments after cu_seqlens.
TILINGS = [
    (128, 512, 4),
    (256, 512, 4),
    (64, 512, 4),
    (128, 256, 2),
    (128, 1024, 4),
    (128, 1024, 8),
    (128, 256, 4),
    (256, 256, 2),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument(
        "--backends", nargs="+", default=["fla", "fla-own-backward", "torch-compiled"]
    )
    parser.add_argument("--tilings", action="store_true")
    args = parser.parse_args()
    backends = list(args.backends)
    backends += ["causal_conv1d"] if importlib.util.find_spec("causal_conv1d") else []
    gen = torch.Generator().manual_seed(0)
    rows = []
    for channels in CHANNELS:
        for length in LENGTHS:
            cu = _cu_seqlens(length, gen).cuda().int()
            x = torch.randn(1, length, channels, generator=gen).cuda()
            w = (0.3 * torch.randn(channels, 4, generator=gen)).cuda()
            grad = torch.randn_like(x)
            reference = _run("torch", x, w, cu, grad, torch.float32)
            for backend in backends:
                result = _run(backend, x, w, cu, grad, torch.bfloat16)
                error = max(_relative_error(a, b) for a, b in zip(result, reference, strict=True))
                ms = _fwd_bwd_ms(backend, x, w, cu, grad)
                row = dict(
                    backend=backend,
                    channels=channels,
                    tokens=length,
                    documents=len(cu) - 1,
                    fwd_bwd_ms=ms,
                    max_rel_error=error,
                )
                rows.append(row)
                print(
                    f"{backend:>16} C={channels:5d} L={length:6d} docs={len(cu) - 1:4d} "
                    f"fwd+bwd {ms:8.3f} ms  max rel err vs fp32 {error:.2e}"
                )
            for tiling in [None, *TILINGS] if args.tilings else []:
                ms = _backward_ms(x, w, cu, grad, tiling)
                rows.append(dict(tiling=tiling, channels=channels, tokens=length, bwd_ms=ms))
                name = "FLA's" if tiling is None else f"ours, (chunk, BD, warps) = {tiling}"
                print(f"  backward alone, {name}: {ms:8.3f} ms")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
