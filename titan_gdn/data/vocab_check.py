"""Token ids outside the model's vocabulary stop training with a message, before the embedding.

On CPU an out-of-range id fails deep inside the embedding ("index out of range in self"), on
CUDA as an asynchronous device-side assert; either way the cause, a tokenizer that does not
belong to the model, is not named. The check runs on the CPU batch, before it moves to the
device.
"""

from __future__ import annotations

import torch
from torchtitan.components.loss import IGNORE_INDEX


class TokenIdError(ValueError):
    """A batch holds a token id the model has no embedding (or output row) for."""


def check_token_ids(
    inputs: torch.Tensor, labels: torch.Tensor, vocab_size: int, flavor: str, tokenizer_path: str
) -> None:
    """Raise `TokenIdError` if `inputs` or `labels` (ignoring IGNORE_INDEX) hold an id outside
    [0, vocab_size)."""
    labels = labels[labels != IGNORE_INDEX]
    for name, ids in (("input", inputs), ("label", labels)):
        outside = ids[(ids < 0) | (ids >= vocab_size)]
        if outside.numel():
            raise TokenIdError(
                f"a training batch holds {name} token id {outside[0].item()} but the model "
                f"(model.flavor = {flavor!r}) has vocab_size = {vocab_size}: the tokenizer in "
                f"model.hf_assets_path = {tokenizer_path!r} (or the data's pre-tokenized ids) "
                "does not match the model; use the model's tokenizer or a flavor whose "
                "vocab_size covers every id"
            )
