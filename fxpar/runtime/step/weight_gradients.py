"""Weight gradients computed later than input gradients, for zero-bubble pipeline schedules.

ZB-H1 (Qi et al. 2024) splits a stage's backward in two: B, the gradient of the stage's inputs,
which the previous stage waits for, and W, the gradient of its weights, which nobody waits
for and which the schedule runs later, in what would otherwise be bubbles. Almost all of W is
the linear layers' `grad_output^T @ input` matmuls, so only those are deferred (as in the
paper's and Megatron-LM's implementations); norms, embeddings and biases keep their gradients
in B, where they cost little.

`fxpar.ops.deferred_linear.linear(x, weight, bias, store)` is the op `passes.weight_gradients` puts
in place of a stage's `aten.linear`; `store` is the stage module's last input,
`weight_gradients`, which the pipeline executor fills with its `WeightGradientStore` in the F
actions of a zero-bubble schedule. Given a store, the op hides the weight from autograd and
its backward returns only the input and bias gradients, recording (weight, input,
grad_output) in the store's collection of the B action running at the time
(`WeightGradientStore.collect`); `WeightGradientStore.run` computes the weight gradient when
the schedule's W action comes. Which B is collecting is state of the store, passed down the
graph like any input: nothing here is global.

Hiding the weight matters: autograd calls a parameter's AccumulateGrad, and its
post-accumulate hooks, even when a backward returns no gradient for it. `run` hands the summed
gradient of each weight to autograd through a view of the weight (`weight.view_as(weight)`), so
it is accumulated into `.grad` exactly as in B and the gradient-bucket hooks
(`register_post_accumulate_grad_hook`) fire once per weight per microbatch, as they do for every
other parameter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias

import torch

from fxpar.ops.deferred_linear import weight_gradient

# What a B action leaves for its W: (weight, input, grad_output) per deferred linear.
_Deferred: TypeAlias = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class WeightGradientStore:
    """The deferred weight gradients of each (stage, microbatch) between its B and its W."""

    def __init__(self):
        self._deferred: dict[tuple[int, int], _Deferred] = {}
        self._collecting: _Deferred | None = None  # of the B action running now, or None

    @contextmanager
    def collect(self, key: tuple[int, int]) -> Iterator[None]:
        """Record the weight gradients of the backward run inside this block under `key`."""
        if key in self._deferred:
            raise RuntimeError(f"weight gradients of {key} are already waiting for their W")
        outer, self._collecting = self._collecting, []
        try:
            yield
            self._deferred[key] = self._collecting
        finally:
            self._collecting = outer

    def record(self, weight: torch.Tensor, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """A deferred linear's backward: keep what its weight gradient needs for the W action."""
        if self._collecting is None:
            raise RuntimeError(
                "the backward of a zero-bubble forward ran outside a B action, so its weight "
                "gradients have no W to go to; run backward inside WeightGradientStore.collect"
            )
        self._collecting.append((weight, x, grad_output))

    def run(self, key: tuple[int, int]) -> None:
        """Compute and accumulate the weight gradients recorded under `key` (the W action)."""
        summed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, x, grad_output in self._deferred.pop(key):
            # No graph: x may require grad (a checkpoint's recomputed input), and autograd
            # would keep x and grad_output for a backward of this matmul no one runs.
            with torch.no_grad():
                grad = weight_gradient(x, grad_output)
            if id(weight) in summed:
                grad = summed[id(weight)][1] + grad
            summed[id(weight)] = (weight, grad)
        if summed:
            weights, grads = zip(*summed.values())
            torch.autograd.backward([w.view_as(w) for w in weights], list(grads))

    def __len__(self) -> int:
        return len(self._deferred)
