"""Opaque differentiable ops, so torch.compile traces the blocks around them without breaks and
activation checkpointing can name them in its policy.

Dynamo cannot trace the ops' insides: FLA and causal_conv1d launch Triton/CUDA kernels
through their own autograd Functions, and the torch backends read document boundaries on the
host (`.tolist()`, data-dependent shapes). As `torch.library` custom ops they are one graph
node each, whose output shape follows from the input shapes alone (the fake implementation).
Eager code calls the same ops, so eager and compiled training run the same kernels and
selective checkpointing sees each kernel as one dispatcher op (see
`titan_gdn.parallel.activation_checkpoint`).

The ops made here save their inputs. Their backward is the backend's own where it needs
only the inputs (FLA's conv: `backward_fn`), else the forward recomputed under autograd on
detached inputs and differentiated: one rule for every backend whose own backward is plain
autograd or an autograd Function, at the cost of one extra forward per backward. Where a
kernel's backward needs its forward's residuals (FLA's delta rule) the op returns and saves
them instead: `delta_rule/fla_op.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from titan_gdn.ops.local_memory import release_after_first_use

NAMESPACE = "titan_gdn"
# Every op of ours launches kernels whose grids follow the documents, reads them on the host or
# communicates: a CUDA graph would replay one batch's launches for the next. With this tag
# inductor leaves the op between its CUDA-graph partitions (`compile.cudagraphs`).
OUTSIDE_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,)


def input_saving_op(
    name: str,
    fn: Callable[..., torch.Tensor],
    arguments: str,
    num_differentiable: int,
    output_like: int,
    backward_fn: Callable[..., list[torch.Tensor] | None] | None = None,
) -> Callable[..., torch.Tensor]:
    """Register `fn` as the custom op `titan_gdn::name`, differentiable in its first
    `num_differentiable` arguments (tensors); returns the function to call.

    `arguments` is the schema's argument list, tensors first, e.g.
    "(Tensor x, Tensor weight, Tensor cu_seqlens, str backend)"; non-tensor arguments are
    compile-time constants. The output has the shape and dtype of argument `output_like`.
    `backward_fn(grad, *args)` returns the gradients of the differentiable arguments, or None
    where it has no backward of its own for these arguments: then `fn` is recomputed and
    differentiated.
    """

    def forward_impl(*args):
        output = fn(*args).contiguous()  # the fake output is contiguous; the real one must be
        release_after_first_use(name, *args[:num_differentiable])
        return output

    forward = register_op(name, forward_impl, f"{arguments} -> Tensor")

    @forward.register_fake
    def _(*args):
        return args[output_like].new_empty(args[output_like].shape)

    def backward_impl(grad, *args):
        grads = backward_fn(grad, *args) if backward_fn is not None else None
        if grads is None:
            inputs = [a.detach().requires_grad_() for a in args[:num_differentiable]]
            with recording_autograd():
                output = fn(*inputs, *args[num_differentiable:])
            grads = torch.autograd.grad(output, inputs, grad, materialize_grads=True)
        release_after_first_use(f"{name}_backward", *args[:num_differentiable])
        return [g.contiguous() for g in grads]

    backward_arguments = f"(Tensor grad, {arguments.removeprefix('(')}"
    backward = register_op(f"{name}_backward", backward_impl, f"{backward_arguments} -> Tensor[]")

    @backward.register_fake
    def _(grad, *args):
        return [a.new_empty(a.shape) for a in args[:num_differentiable]]

    def setup_context(ctx, inputs, output):
        tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.constants = inputs[len(tensors) :]

    def backward_formula(ctx, grad):
        # saved_tensors is read once: activation checkpointing allows one unpack per tensor.
        inputs = (*ctx.saved_tensors, *ctx.constants)
        grads = backward(grad, *inputs)
        return *grads, *[None] * (len(inputs) - len(grads))

    forward.register_autograd(backward_formula, setup_context=setup_context)
    return forward


def register_op(name: str, fn: Callable, schema: str):
    """`fn` as the custom op `titan_gdn::name` of `schema`, kept out of CUDA graphs."""
    return torch.library.custom_op(
        f"{NAMESPACE}::{name}", fn, mutates_args=(), schema=schema, tags=OUTSIDE_CUDA_GRAPHS
    )


@contextlib.contextmanager
def recording_autograd():
    # An op's implementation runs below autograd, with its dispatch keys excluded: there
    # enable_grad alone records nothing, so the keys come back for the recompute.
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther)
    with contextlib.ExitStack() as stack:
        for key in keys:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        yield
