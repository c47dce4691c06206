"""Weight gradients computed later than input gradients, for zero-bubble pipeline schedules.

ZB-H1 (Qi et al. 2024) splits a stage's backward in two: B, the gradient of the stage's inputs,
which the previous stage waits for, and W, the gradient of its weights, which nobody waits
for and which the schedule runs later, in what would otherwise be bubbles. Almost all of W is
the linear layers' `grad_output^T @ input` matmuls, so only those are deferred (as in the
paper's and Megatron-LM's implementations); norms, embeddings and biases keep their gradients
in B, where they cost little.

`linear(x, weight, bias)` is the op `passes.weight_gradients` puts in place of a stage's
`aten.linear`. Inside `deferring()` (the executor's F actions of a
zero-bubble schedule) it hides the weight from autograd and its backward returns only the input
and bias gradients, recording (weight, input, grad_output) in the store's collection of the B
action running at the time; `WeightGradientStore.run` computes the weight gradient when the
schedule's W action comes. Anywhere else it is `F.linear`, so a stage module run by hand (or
under another schedule) is an ordinary differentiable function.

Hiding the weight matters: autograd calls a parameter's AccumulateGrad, and its
post-accumulate hooks, even when a backward returns no gradient for it. `run` hands the summed
gradient of each weight to autograd through a view of the weight (`weight.view_as(weight)`), so
it is accumulated into `.grad` exactly as in B and the gradient-bucket hooks
(`register_post_accumulate_grad_hook`) fire once per weight per microbatch, as they do for every
other parameter.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

_deferring = False  # inside WeightGradientStore.deferring(): linear() defers its weight gradient
# The (weight, input, grad_output) triples of the B action running now, or None.
_collecting: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


def _weight_gradient(x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """d(x @ W^T)/dW contracted with grad_output: grad_output^T @ x over all leading dims."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _Weight:
    """The parameter behind a detached weight; not a tensor, so autograd draws no edge to it."""

    def __init__(self, parameter: torch.Tensor):
        self.parameter = parameter


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: _Weight):
        ctx.save_for_backward(x, weight)
        ctx.owner = owner
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        needs_x, _, needs_bias, _ = ctx.needs_input_grad
        grad_x = grad_output.matmul(weight) if needs_x else None
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if needs_bias else None
        if ctx.owner.parameter.requires_grad:
            if _collecting is None:
                raise RuntimeError(
                    "the backward of a zero-bubble forward ran outside a B action, so its weight "
                    "gradients have no W to go to; run backward inside WeightGradientStore.collect"
                )
            _collecting.append((ctx.owner.parameter, x, grad_output))
        return grad_x, None, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; inside `deferring()` its weight gradient waits for a W action (module doc)."""
    if not _deferring:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight.detach(), bias, _Weight(weight))


@contextmanager
def deferring():
    """Forwards run inside this block leave their linear weights' gradients to a W action."""
    global _deferring
    outer, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = outer


class WeightGradientStore:
    """The deferred weight gradients of each (stage, microbatch) between its B and its W."""

    def __init__(self):
        self._deferred: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    @contextmanager
    def collect(self, key: tuple[int, int]):
        """Record the weight gradients of the backward run inside this block under `key`."""
        global _collecting
        if key in self._deferred:
            raise RuntimeError(f"weight gradients of {key} are already waiting for their W")
        outer, _collecting = _collecting, []
        try:
            yield
            self._deferred[key] = _collecting
        finally:
            _collecting = outer

    def run(self, key: tuple[int, int]) -> None:
        """Compute and accumulate the weight gradients recorded under `key` (the W action)."""
        summed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, x, grad_output in self._deferred.pop(key):
            grad = _weight_gradient(x, grad_output)
            if id(weight) in summed:
                grad = summed[id(weight)][1] + grad
            summed[id(weight)] = (weight, grad)
        if summed:
            weights, grads = zip(*summed.values())
            torch.autograd.backward([w.view_as(w) for w in weights], list(grads))

    def __len__(self) -> int:
        return len(self._deferred)
