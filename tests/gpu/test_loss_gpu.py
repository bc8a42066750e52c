"""The chunked loss compiled by inductor on a GPU against the plain loss: the compiled step
writes d(loss)/d(logits) into a slice of the gradient buffer (a mutated input view)."""

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from titan_gdn.loss import chunk_loss_and_grad, chunked_cross_entropy

pytestmark = pytest.mark.gpu


def _loss_and_grads(loss_fn, hidden, weight, labels):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def test_compiled_chunked_loss_matches_the_plain_loss_in_bf16():
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens, dim, vocab = 5000, 512, 32768  # 5 chunks of 1,024: a full group and a short one
    hidden = torch.randn(tokens, dim, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, dim, device="cuda", generator=gen) / dim**0.5).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    labels[::9] = -100
    step = torch.compile(chunk_loss_and_grad)

    def plain(h, w, y):
        return F.cross_entropy((h @ w.T).float(), y, reduction="sum", ignore_index=-100)

    def chunked(h, w, y):
        return chunked_cross_entropy(h, w, y, 1024, step)

    want = _loss_and_grads(plain, hidden, weight, labels)
    for _ in range(2):  # the second call runs the cached graphs
        got = _loss_and_grads(chunked, hidden, weight, labels)
    errors = [relative_error(a, b) for a, b in zip(got, want, strict=True)]
    print(
        f"compiled chunked vs plain, bf16: loss {errors[0]:.1e}, grad hidden {errors[1]:.1e}, "
        f"grad weight {errors[2]:.1e}"
    )
    assert errors[0] <= 1e-5  # the same bf16 logits, upcast
    assert max(errors[1:]) <= 1e-2  # bf16 gradients, rounded in a different order
