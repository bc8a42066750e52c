"""The Triton conv backward (`titan_gdn.ops.conv_backward`) against autograd through the torch
conv in float64, run on CPU by Triton's interpreter (in a child process: the interpreter is
chosen when the kernel is defined; one child runs every case, so torch is imported once). The
GPU run of the same kernel is tests/gpu/test_model_gpu.py.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent(
    """
    import json, sys, traceback
    import torch
    from titan_gdn.ops.conv import _causal_conv1d_torch
    from titan_gdn.ops.conv_backward import causal_conv1d_silu_backward

    def errors(seed, length, channels, chunk, block_d):
        gen = torch.Generator().manual_seed(seed)
        # Boundaries at and next to chunk edges, one-token documents, trailing empty documents.
        cuts = {chunk - 2, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 1, 2}
        cuts |= set(torch.randint(1, length, (length // 40,), generator=gen).tolist())
        cuts = sorted(c for c in cuts if 0 < c < length)
        cu = torch.tensor([0, *cuts, length, length, length], dtype=torch.int32)
        x = torch.randn(1, length, channels, generator=gen, dtype=torch.float64)
        w = 0.5 * torch.randn(channels, 4, generator=gen, dtype=torch.float64)
        dy = torch.randn(1, length, channels, generator=gen, dtype=torch.float64)
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        _causal_conv1d_torch(*leaves, cu).backward(dy)
        dx, dw = causal_conv1d_silu_backward(dy.float(), x.float(), w.float(), cu, chunk, block_d)

        def relative(a, b):
            return ((a.double() - b).norm() / b.norm()).item()

        return {"dx": relative(dx, leaves[0].grad), "dw": relative(dw, leaves[1].grad),
                "dtypes": [str(dx.dtype), str(dw.dtype)]}

    results = []
    for case in json.loads(sys.argv[1]):
        try:
            results.append(errors(*case))
        except Exception:  # reported by the case's own test
            results.append({"error": traceback.format_exc()})
    print(json.dumps(results))
    """
)


# Chunks of a few rows, so that documents and row ends cross them in every way; strips of
# channels that the channels fill (64 of 64, 32 of 96) or not (64 of 96, 32 of 40, 512 of 24).
CASES = [(0, 300, 96, 16, 64), (1, 129, 64, 32, 64), (2, 200, 40, 8, 32), (3, 37, 24, 128, 512),
         (4, 150, 96, 7, 32)]  # fmt: skip


@pytest.fixture(scope="module")
def errors_by_case() -> dict[tuple[int, ...], dict]:
    """Every case's errors (or traceback) from one interpreted child process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(CASES)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    return dict(zip(CASES, results, strict=True))


@pytest.mark.parametrize("seed, length, channels, chunk, block_d", CASES)
def test_backward_matches_autograd_through_the_torch_conv(
    errors_by_case, seed, length, channels, chunk, block_d
):
    errors = errors_by_case[seed, length, channels, chunk, block_d]
    assert "error" not in errors, errors.get("error")
    # fp32 kernel against the torch conv, which computes in fp32 too: float rounding only.
    assert errors["dx"] < 1e-5 and errors["dw"] < 1e-5, errors
    assert errors["dtypes"] == ["torch.float32", "torch.float32"]
