"""Cross-entropy that never materialises full-sequence logits (chunked linear + cross-entropy),
and the MoE models' load-balancing loss.

torchtitan's trainer calls ``loss_fn(model(inputs, ...), labels)`` and never hands the model to
the loss. So in training the model returns `OutputHidden` (final hidden states and its output
projection) instead of logits, and the loss computes the logits a token chunk at a time. The
gradients w.r.t. the hidden states and the output weight are computed in the forward pass, so
neither pass keeps more than one chunk of logits alive: d(loss)/d(logits) of a few chunks is
gathered into one buffer and meets the weight and the hidden states in one GEMM each.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss
from torchtitan.tools.logging import logger

# Chunks whose d(loss)/d(logits) share one pair of gradient GEMMs. Each weight-gradient GEMM
# is followed by a separate fp32 add over the whole [vocab, dim] gradient (a bf16 GEMM cannot
# accumulate into fp32 in torch 2.11): 6 GB of memory traffic at Qwen3.5's vocabulary and dim
# 2048. One per 4 chunks takes a quarter of that traffic, for a [4 x chunk, vocab] buffer in
# the hidden states' dtype (2 GB at 1,024-token chunks).
CHUNKS_PER_GRADIENT_GEMM = 4


@dataclass
class OutputHidden:
    """What the model returns for a chunked loss: `hidden` [B, T, dim] before the output
    projection `head`, and the token chunk size the loss should use.

    A dataclass, so that FSDP2 finds `hidden` and hooks its backward; `head` is a module,
    which FSDP leaves alone (a hook on the weight itself would outlive the step).
    """

    hidden: torch.Tensor
    head: nn.Linear
    chunk_tokens: int

    @property
    def weight(self) -> torch.Tensor:
        weight = self.head.weight
        if isinstance(weight, DTensor):
            # FSDP resharded the head after forward (fsdp_reshard_after_forward = "always"):
            # gather it again; FSDP reshards it after its backward.
            self.head.unshard()
            weight = self.head.weight
        return weight


@dataclass
class RoutedOutput:
    """The model's `output` (logits or `OutputHidden`) and, per MoE layer, the router's
    probabilities [N, E] (fp32) and chosen experts [N, k] for this rank's N tokens, with the
    weight of the load-balancing loss. A dataclass, so that FSDP2 finds its tensors."""

    output: torch.Tensor | OutputHidden
    router_probs: list[torch.Tensor]
    router_experts: list[torch.Tensor]
    aux_loss_coef: float


class AuxLossTally:
    """The load-balancing loss of each micro-batch since the last log (read by the metrics)."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def take(self) -> float | None:
        values, self.values = self.values, []
        return torch.stack(values).mean().item() if values else None


ROUTER_AUX_LOSS = AuxLossTally()


def load_balancing_loss(
    probs: list[torch.Tensor],
    experts: list[torch.Tensor],
    real: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' `load_balancing_loss_func` over the real tokens (`real`, [N] bool) of
    every rank in `group` (the ranks that share the batch: data and context parallel).

    With L layers, R real token-layer rows, C_e the rows that picked expert e and P_e the sum
    of its probabilities: aux = E * sum_e (C_e / R) (P_e / R). C is counted, not differentiated,
    so aux is linear in each rank's probabilities: this rank's part, E / R^2 * sum_e C_e P_e^rank
    with the global C and R, sums over the ranks to aux and gives each rank its gradient.
    Returns (this rank's part, aux, the real tokens of all ranks); one all-reduce of 2E + 1
    numbers.
    """
    num_experts, top_k = probs[0].shape[-1], experts[0].shape[-1]
    mask = real.flatten().to(torch.float64)
    counts = mask.new_zeros(num_experts)
    for chosen in experts:
        counts.scatter_add_(0, chosen.flatten(), mask.repeat_interleave(top_k))
    prob_sums = sum((p * mask.to(p.dtype).unsqueeze(-1)).sum(0) for p in probs)
    totals = torch.cat([counts, prob_sums.detach().double(), mask.sum().view(1)])
    if group is not None:
        dist.all_reduce(totals, group=group)
    counts, all_prob_sums, tokens = totals[:num_experts], totals[num_experts:-1], totals[-1]
    rows = tokens * len(probs)
    scale = num_experts / rows.clamp_min(1) ** 2
    part = scale.float() * (counts.float() * prob_sums).sum()
    return part, (scale * (counts * all_prob_sums).sum()).float(), tokens


def router_aux_loss_sum(pred: RoutedOutput, labels: torch.Tensor, group=None) -> torch.Tensor:
    """coef * this rank's part of the aux loss, times the micro-batch's real tokens: the trainer
    divides the summed loss by the step's real tokens, so each micro-batch's aux loss enters the
    step's loss weighted by its share of the tokens (with one micro-batch: coef * aux)."""
    part, aux, tokens = load_balancing_loss(
        pred.router_probs, pred.router_experts, labels != IGNORE_INDEX, group
    )
    ROUTER_AUX_LOSS.values.append(aux.detach())
    return pred.aux_loss_coef * part * tokens.float()


def chunk_loss_and_grad(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grad_out: torch.Tensor | None
) -> torch.Tensor:
    """Summed cross-entropy of one chunk, as torchtitan computes the loss: logits in the
    parameters' dtype, upcast to fp32. With `grad_out`, d(loss)/d(logits) is written into it,
    in its dtype (the hidden states', the one the gradient GEMMs take): compiled, the fp32
    gradient is never written, only that."""
    logits = (hidden @ weight.T).float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0).unsqueeze(1)
    loss = torch.where(valid, lse - logits.gather(1, target).squeeze(1), 0.0).sum()
    if grad_out is not None:
        # softmax - one_hot(target) as one element-wise expression, not a scatter: compiled,
        # it is one kernel from the logits to `grad_out`, with no fp32 gradient in between.
        probs = (logits - lse.unsqueeze(1)).exp()
        is_target = torch.arange(logits.shape[1], device=logits.device) == target
        grad = torch.where(is_target, probs - 1.0, probs)
        grad_out.copy_(torch.where(valid.unsqueeze(1), grad, 0.0))
    return loss


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, step):
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        # fp32 accumulation: a sum of per-group products in bf16 would lose the small ones.
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        group_tokens = chunk_tokens * CHUNKS_PER_GRADIENT_GEMM
        grad_logits = hidden.new_empty((min(group_tokens, hidden.shape[0]), weight.shape[0]))
        total = hidden.new_zeros((), dtype=torch.float32)
        for group_start in range(0, hidden.shape[0], group_tokens):
            group = slice(group_start, group_start + group_tokens)
            h, y = hidden[group], labels[group]
            g = grad_logits[: h.shape[0]]
            for s in range(0, h.shape[0], chunk_tokens):
                rows = slice(s, s + chunk_tokens)
                total += step(h[rows], weight, y[rows], g[rows])
            if want_h:
                torch.mm(g, weight, out=grad_h[group])
            if want_w and grad_w.dtype == h.dtype:
                grad_w.addmm_(g.T, h)
            elif want_w:
                grad_w += g.T @ h
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        # In place: these buffers are as large as the hidden states and the output weight.
        # A second backward through the same graph then fails on the version check.
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    step=chunk_loss_and_grad,
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, labels), ignoring IGNORE_INDEX;
    `hidden` [N, dim], `labels` [N]. Exact against the plain loss; `step` computes one chunk
    (a torch.compile'd `chunk_loss_and_grad` fuses its element-wise work)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    hidden, weight = _in_compute_dtype(hidden, weight)
    # Autocast off inside: the operands are already in the compute dtype, and autocast does
    # not follow the in-place and out= GEMMs anyway; fp32 appears only where it accumulates.
    with torch.autocast(hidden.device.type, enabled=False):
        needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        if needs_grad:
            return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, step)
        losses = [
            step(hidden[s : s + chunk_tokens], weight, labels[s : s + chunk_tokens], None)
            for s in range(0, hidden.shape[0], chunk_tokens)
        ]
        return torch.stack(losses).sum()


def _in_compute_dtype(
    hidden: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands in the dtype the vocabulary GEMMs should run in: autocast's where it is on
    (one GPU without FSDP: fp32 parameters, fp32 final norm), else the weight's (FSDP's
    mixed_precision_param). The casts are differentiable: gradients return in the callers'
    dtypes."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return hidden.to(dtype), weight.to(dtype)


def qwen3_5_loss(pred, labels: torch.Tensor, *, plain=cross_entropy_loss, step=None, group=None):
    """torchtitan's summed cross-entropy for logits, or its chunked form for `OutputHidden`;
    for a `RoutedOutput`, plus its load-balancing loss over the ranks of `group`."""
    if isinstance(pred, RoutedOutput):
        loss = qwen3_5_loss(pred.output, labels, plain=plain, step=step)
        return loss + router_aux_loss_sum(pred, labels, group() if callable(group) else group)
    if not isinstance(pred, OutputHidden):
        return plain(pred, labels)
    return chunked_cross_entropy(
        pred.hidden.flatten(0, 1),
        pred.weight,
        labels.flatten(0, 1),
        pred.chunk_tokens,
        step or chunk_loss_and_grad,
    )


def build_qwen3_5_loss(job_config, parallel_dims=None, **kwargs):
    """TrainSpec `build_loss_fn`: with "loss" in compile.components, the plain loss is
    compiled as torchtitan does, and the chunked loss compiles its per-chunk step (its loop
    stays eager: unrolled, it would be a graph per sequence length). The load-balancing loss
    is reduced over torchtitan's `loss` mesh (data x context parallel)."""
    del kwargs
    group = functools.partial(_loss_group, parallel_dims)
    if not (job_config.compile.enable and "loss" in job_config.compile.components):
        return functools.partial(qwen3_5_loss, group=group)
    logger.info("Compiling the loss function (per chunk for the chunked loss) with torch.compile")
    backend = job_config.compile.backend
    return functools.partial(
        qwen3_5_loss,
        plain=torch.compile(cross_entropy_loss, backend=backend),
        step=torch.compile(chunk_loss_and_grad, backend=backend),
        group=group,
    )


def _loss_group(parallel_dims) -> dist.ProcessGroup | None:
    # Resolved at the first MoE loss: the meshes exist by then.
    if parallel_dims is None or not parallel_dims.dp_cp_enabled:
        return None
    return parallel_dims.get_mesh("loss").get_group()
