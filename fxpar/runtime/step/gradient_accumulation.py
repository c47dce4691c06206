"""Gradient accumulation across steps: `runner.step` twice without `zero_grad` sums, as one device does.

On one device `loss1.backward(); loss2.backward()` leaves `.grad = g1 + g2`: autograd adds
each new gradient into the one already there. A manual accumulation loop relies on it:

    for tokens, labels in microbatches:                  # no zero_grad in between
        runner.step(*runner.local_batch(tokens, labels))
    opt.step(); opt.zero_grad()

A distributed step cannot let autograd add into what the last step left, because the step does
more than backward. Its collectives act on the gradient buffers in place, and what is already
there would be reduced again:

    dp buckets      the bucket all-reduce sums the ranks' buffers (each holds its share of
                    the global mean: `runtime.step.loss`), so a held g1 comes back dp x g1;
                    where the count of valid targets rides in the bucket (`riding_count`) the
                    sum is then divided by this step's count: g1 x dp / count (two steps of
                    one batch of 128 targets at dp=2 left 1 + 2/128 times its gradient, not 2)
    ZeRO-1/2        the reduce-scatter writes over the reduced shard (ZeRO-2), or reduces
                    a buffer whose own shard holds g1 reduced and the rest the unreduced local
                    g1 (ZeRO-1)
    tp, pp          the partial-gradient sum over tp (sequence parallelism's norms) and the
                    tied-weight sum over pp add every copy's g1 again: tp x g1, copies x g1

So a step sets the earlier gradients aside before its first forward (`set_aside`: the state
`opt.zero_grad()` leaves), runs as a fresh step, and adds them to its own after its last
collective (`add_back`): `.grad = g2 + g1`, the same floating-point sum as one device's
`g1 + g2`. Where a gradient lives decides what is set aside:

    a parameter's `.grad`      dp (zero=0), tp, pp, ZeRO-3's pieces: moved aside, or copied
                               where it is a view of a gradient bucket (the bucket is zeroed
                               for the step's backward)
    a ZeRO-1/2 reduced shard   `GradientBuckets.shard_gradient`, what the sharded optimizer
                               steps: moved aside, copied under ZeRO-1 (it is a view of the
                               bucket); the parameters' `.grad` there is scratch (ZeRO-1's
                               views mix reduced and unreduced values, ZeRO-2 keeps none)

Under ZeRO-1/2 the reduced shard, not `.grad`, is the gradient: `opt.zero_grad()` (the
`ShardedOptimizer`'s) clears it (`GradientBuckets.forget_reduced`); a module's own
`zero_grad()` does not reach it.

Cost: a step that accumulates copies each bucketed gradient once (P elements, or P/N under
ZeRO-1) and holds it until its end; one that follows `zero_grad` finds nothing to set aside
and copies nothing. bf16-mixed adds in the gradients' dtype (bf16 `.grad`, as one device's
bf16 weights accumulate; ZeRO's reduced shard in `reduce_dtype`).

A step that fails puts the earlier gradients back as they were and drops its own partial ones
(`put_back`), so a retried step accumulates onto what was there before the failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fxpar.runtime.state.gradient_buckets import _BucketState
    from fxpar.runtime.step.context import StepContext


@dataclass
class EarlierGradients:
    """What earlier steps left, set aside while a step runs (module doc)."""

    parameters: list[torch.nn.Parameter]  # every parameter of the rank's modules, each once
    grads: dict[int, torch.Tensor]  # id(parameter) -> its earlier `.grad`
    shards: list[tuple[_BucketState, torch.Tensor | None]]  # ZeRO-1/2: each bucket's earlier reduced shard

    @classmethod
    def set_aside(cls, context: StepContext) -> EarlierGradients:
        """Take every gradient the rank holds out of the step's way, leaving what `zero_grad`
        leaves (no `.grad`, no reduced shard); call before the step's first forward."""
        buffers = {s.buffer.untyped_storage().data_ptr() for b in context.buckets for s in b.states
                   if s.buffer is not None}
        sharded: set[int] = set()  # ZeRO-1/2's bucketed parameters: their gradient is the shard
        shards = []
        for buckets in context.buckets:
            if not buckets.zero:
                continue
            for state in buckets.states:
                sharded.update(map(id, state.parameters))
                reduced = state.reduced
                if reduced is not None and reduced.untyped_storage().data_ptr() in buffers:
                    reduced = reduced.clone()  # ZeRO-1: the shard is a view of the bucket
                shards.append((state, reduced))
                state.reduced = None
        parameters = list({id(p): p for m in context.modules for p in m.parameters()}.values())
        grads = {}
        for parameter in parameters:
            grad = parameter.grad
            if grad is None:
                continue
            if id(parameter) not in sharded:
                in_bucket = grad.untyped_storage().data_ptr() in buffers
                grads[id(parameter)] = grad.detach().clone() if in_bucket else grad
            parameter.grad = None
        return cls(parameters, grads, shards)

    def add_back(self) -> None:
        """Add the earlier gradients to the step's (after its last collective): `.grad` and
        each reduced shard become their sum, as one device's second backward leaves it."""
        with torch.no_grad():
            for state, earlier in self.shards:
                if earlier is None:
                    continue
                if state.reduced is None:  # (every bucket is reduced by a step that completes)
                    state.reduced = earlier
                else:
                    state.reduced.add_(earlier)
            for parameter in self.parameters:
                earlier = self.grads.get(id(parameter))
                if earlier is None:
                    continue
                if parameter.grad is None:  # (this step gave it none: it is not trained here)
                    parameter.grad = earlier
                else:
                    parameter.grad.add_(earlier)
        self.grads, self.shards = {}, []

    def put_back(self) -> None:
        """After a failed step: every gradient as it was before the step, the step's partial
        ones dropped."""
        for state, earlier in self.shards:
            state.reduced = earlier
        for parameter in self.parameters:
            parameter.grad = self.grads.get(id(parameter))
        self.grads, self.shards = {}, []
