"""ZeRO-1 and ZeRO-2 at run time: each rank keeps optimizer state for its shard alone.

ZeRO (Rajbhandari et al. 2020, Sec. 5) partitions the optimizer state over the N
data-parallel ranks (stage 1, P_os) and the gradients too (stage 2, P_os+g). fxpar lays each
gradient bucket's parameters out as one flat, padded buffer (`Bucket.padded`): at bind each
parameter becomes a view into its bucket's flat parameter buffer, so rank i's shard is one
contiguous slice, `Bucket.shard(N, i)`, and the optimizer is built over those slices:

    flat parameters of bucket b   [ p0 | p1 | p2 ... | pad ]      views: p.data
    rank i's shard                          [  shard i  ]          the inner optimizer's tensor
    its gradient                  the bucket's reduce-scatter (`GradientBuckets.shard_gradient`)

Under bf16-mixed the inner optimizer steps this rank's fp32 master shards instead
(`runtime.master_weights`), and each master is rounded into its bf16 shard before the gather,
so parameters travel in bf16.

`step()` steps the inner optimizer on the shards (8P/N bytes of Adam state instead of 8P), then
runs the step program's optimizer part: each bucket's updated parameters all-gathered over dp
in place, into the flat buffer the parameters view. What the step program lists is what runs:
the calls are held to it by a step guard.

The inner optimizer must be elementwise, so that stepping a slice of a flat buffer is
stepping each parameter: SGD (with momentum or Nesterov), Adam, AdamW, Adamax, NAdam, RAdam,
Adagrad, Adadelta, RMSprop, Rprop and ASGD are. One that reads whole tensors (LBFGS, LAMB's
per-tensor trust ratio, Adafactor's factored moments) would compute something else on a
shard: it is refused, naming it; `elementwise=True` vouches for another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fxpar.errors import PlanError
from fxpar.runtime.step_guard import StepGuard
from fxpar.runtime.wrapped_optimizer import WrappedOptimizer
from fxpar.step_program import Purpose

if TYPE_CHECKING:
    from fxpar.runtime.gradient_buckets import GradientBuckets
    from fxpar.runtime.master_weights import MasterWeights
    from fxpar.runtime.step_context import StepContext

ELEMENTWISE = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
}


def require_elementwise(optimizer_class: type, *, zero: int, elementwise: bool) -> None:
    """Refuse an optimizer not known to treat every element alone (module doc), naming it."""
    if optimizer_class in ELEMENTWISE or elementwise:
        return
    raise PlanError(
        f"plan zero={zero} steps each rank's shard of flat parameter buffers, so the optimizer "
        f"must treat every element alone; {optimizer_class.__name__} is not known to (it may read "
        "whole tensors: a trust ratio, factored moments, a line search). Fix: use an elementwise "
        "optimizer (SGD, Adam, AdamW, ...), zero=0, or runner.optimizer(cls, elementwise=True, ...) "
        "if it is elementwise",
        field="zero",
        value=zero,
    )


def flatten_parameters(buckets: GradientBuckets) -> list[torch.Tensor]:
    """Make each bucket's parameters views into one flat padded buffer per bucket (values
    kept); returns the buffers, in bucket order."""
    flats = []
    with torch.no_grad():
        for state in buckets.states:
            flat = torch.zeros(state.size, dtype=state.bucket.dtype, device=state.device)
            offset = 0
            for p in state.parameters:
                flat[offset : offset + p.numel()].copy_(p.reshape(-1))
                p.data = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            flats.append(flat)
    return flats


class ShardedOptimizer(WrappedOptimizer):
    """`optimizer_class` over this rank's shards of the flat parameter buckets (module doc).

    Use it as the optimizer itself: `opt.step()`, `opt.zero_grad()`; `opt.optimizer` is the
    inner one, over the shards."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        options: dict[str, Any],
        *,
        context: StepContext,
        flats: list[list[torch.Tensor]],
        elementwise: bool = False,
        masters: MasterWeights | None = None,
    ):
        require_elementwise(optimizer_class, zero=context.buckets[0].zero, elementwise=elementwise)
        self.context = context
        self._flats = flats  # per module, per bucket
        self._shards: list[tuple[GradientBuckets, int, torch.Tensor]] = []
        self._working: list[torch.Tensor | None] = []  # bf16-mixed: each stepped master's bf16 shard
        for module, (buckets, module_flats) in enumerate(zip(context.buckets, flats)):
            dp = buckets.group
            for index, (state, flat) in enumerate(zip(buckets.states, module_flats)):
                shard = flat[state.bucket.shard(dp.size, dp.index)]
                master = masters.shard_of(module, index) if masters else None
                self._shards.append((buckets, index, shard if master is None else master))
                self._working.append(None if master is None else shard)
        self.optimizer = optimizer_class([shard for _, _, shard in self._shards], **options)
        self._guard = StepGuard(context.step_program, "optimizer")

    @property
    def shards(self) -> list[tuple[GradientBuckets, int, torch.Tensor]]:
        """(buckets, bucket index, this rank's shard of its flat parameters: what the inner
        optimizer steps, its fp32 master under bf16-mixed) per bucket."""
        return list(self._shards)

    def step(self, closure: Callable | None = None):
        """Step this rank's shards on their reduced gradients, then gather every bucket's
        updated parameters (the step program's optimizer part)."""
        for buckets, index, shard in self._shards:
            gradient = buckets.shard_gradient(index)
            shard.grad = gradient.to(shard.dtype)  # bf16-mixed's fp32 master, a bf16 reduction
        loss = self.optimizer.step(closure)
        with torch.no_grad():
            for (_, _, master), working in zip(self._shards, self._working):
                if working is not None:  # the master rounded into the bf16 flat bucket
                    working.copy_(master)
                    master.grad = None
        self._guard.start({})
        communicator = self.context.communicator
        with communicator.held_to(self._guard):
            gathers = []  # all in flight at once, then waited for
            for action in self.context.step_program.optimizer:
                if action.purpose is not Purpose.UPDATED_PARAMETERS:
                    raise AssertionError(f"an optimizer action of purpose {action.purpose}")
                module = self.context.module_of_stage[action.stage]
                buckets, flat = self.context.buckets[module], self._flats[module][action.index]
                state = buckets.states[action.index]
                shard = flat[state.bucket.shard(buckets.group.size, buckets.group.index)]
                gathers.append(communicator.all_gather(flat, shard, buckets.group, tag=action.calls[0].tag, phase="step"))
            for gather in gathers:
                gather.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the step's gradients: the shards' and the parameters' own."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for module in self.context.modules:
            for parameter in module.parameters():
                if set_to_none:
                    parameter.grad = None
                elif parameter.grad is not None:
                    parameter.grad.zero_()
