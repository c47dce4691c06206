"""The deferred linear: the op `passes.weight_gradients` puts in place of a stage's linears.

Zero-bubble schedules (ZB-H1, Qi et al. 2024) run a stage's backward as B (input gradients)
and, later, W (weight gradients); almost all of W is the linear layers' `grad_output^T @ input`
matmuls, so only those wait (`runtime.step.weight_gradients` has the whole story and the store).

`linear(x, weight, bias, store)` is `F.linear` when `store` is None. Given a store (anything
with `record(weight, input, grad_output)`: the runtime's `WeightGradientStore`), it hides the
weight from autograd and its backward returns only the input and bias gradients, recording
what the weight gradient needs in the store for the W action. `deferrable` says which
weights may wait: those only linears read, as their weight.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

LINEAR = torch.ops.aten.linear.default


def weight_gradient(x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """d(x @ W^T)/dW contracted with grad_output: grad_output^T @ x over all leading dims."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _Weight:
    """The parameter behind a detached weight; not a tensor, so autograd draws no edge to it."""

    def __init__(self, parameter: torch.Tensor):
        self.parameter = parameter


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                owner: _Weight, store):
        ctx.save_for_backward(x, weight)
        ctx.owner, ctx.store = owner, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        needs_x, _, needs_bias, _, _ = ctx.needs_input_grad
        grad_x = grad_output.matmul(weight) if needs_x else None
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if needs_bias else None
        if ctx.owner.parameter.requires_grad:
            ctx.store.record(ctx.owner.parameter, x, grad_output)
        return grad_x, None, grad_bias, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    store=None,
) -> torch.Tensor:
    """`F.linear`; given a `store`, its weight gradient waits in it for a W action (module doc)."""
    if store is None:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight.detach(), bias, _Weight(weight), store)


def stands_for(node: fx.Node):
    """The aten op a node computes: `aten.linear` for a deferred linear (the cost model prices
    it as one), the node's own target otherwise."""
    return LINEAR if node.target is linear else node.target


def deferrable(weight: fx.Node) -> bool:
    """Whether the gradient of the parameter `weight` reads can wait for W: every reader is an
    `aten.linear` that reads it as its weight, and only there (the cost model's criterion too)."""
    readers = list(weight.users)
    return bool(readers) and all(_reads_as_weight(node, weight) for node in readers)


def _reads_as_weight(node: fx.Node, weight: fx.Node) -> bool:
    return (
        node.op == "call_function" and node.target is LINEAR
        and len(node.args) >= 2 and node.args[1] is weight and weight not in (node.args[0], *node.args[2:])
        and not node.kwargs
    )
