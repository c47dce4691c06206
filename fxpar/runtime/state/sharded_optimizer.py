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
(`runtime.state.master_weights`), and each master is rounded into its bf16 shard before the gather,
so parameters travel in bf16.

With optimizer parameter groups (`runtime.state.parameter_groups`) a shard whose parameters are in
several groups is cut into runs of one group (`group_runs`), each a tensor of the inner
optimizer in its group; one group keeps the shard whole. Each run has its own 0-dim state
(Adam's `step`, 4 bytes), which the estimate, made before any group is known, counts once
per shard. The state of a shard (`shard_state`) is its runs' end to end.

`step()` steps the inner optimizer on the shards (8P/N bytes of Adam state instead of 8P), then
runs the step program's optimizer part: each bucket's updated parameters all-gathered over dp
in place, into the flat buffer the parameters view. What the step program lists is what runs:
the calls are held to it by a step guard.

An expert's weights under ep are in no bucket (their gradients are summed over the ranks
holding the same experts): the inner optimizer steps them whole beside the shards (`whole`),
each rank its own experts, nothing gathered after.

The inner optimizer must be elementwise, so that stepping a slice of a flat buffer is
stepping each parameter (`runtime.state.optimizer_reads`: one that reads whole tensors is refused,
naming it; `elementwise=True` vouches for another).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.step_program import Purpose
from fxpar.runtime.state.optimizer_reads import require_elementwise
from fxpar.runtime.state.parameter_groups import ParameterGroups
from fxpar.runtime.state.wrapped_optimizer import WrappedOptimizer
from fxpar.runtime.step.guard import StepGuard

if TYPE_CHECKING:
    from fxpar.runtime.state.gradient_buckets import GradientBuckets
    from fxpar.runtime.state.master_weights import MasterWeights
    from fxpar.runtime.step.context import StepContext


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


@dataclass(frozen=True)
class ShardRun:
    """Elements [start, stop) of a rank's shard whose parameters are all in one optimizer
    group: one tensor of the inner optimizer, a view of the shard."""

    start: int
    stop: int
    group: int
    tensor: torch.Tensor


def group_runs(buckets: GradientBuckets, index: int, shard: torch.Tensor, groups: ParameterGroups) -> list[ShardRun]:
    """`shard` (this rank's of bucket `index`) cut where the group of its parameters changes;
    the padding after the last parameter rides with the last run. One group: the shard whole."""
    runs: list[tuple[int, int]] = []  # (start, group)
    for name, _, _, start, _ in buckets.shard_spans(index):
        group = groups.group_of(name)
        if not runs or runs[-1][1] != group:
            runs.append((start, group))
    if not runs:  # the shard is all padding
        runs = [(0, groups.group_of(buckets.states[index].bucket.parameters[-1]))]
    stops = [start for start, _ in runs[1:]] + [shard.numel()]
    return [ShardRun(start, stop, group, shard[start:stop]) for (start, group), stop in zip(runs, stops)]


def unbucketed(context: StepContext) -> list[tuple[str, torch.nn.Parameter]]:
    """The trained parameters in no gradient bucket, by name: an expert's weights under ep,
    whose gradients are summed over edp (`passes.expert_parallel`)."""
    return [(n, m.get_parameter(n)) for m in context.modules for n in meta.unbucketed_parameters(m.graph)]


class ShardedOptimizer(WrappedOptimizer):
    """`optimizer_class` over this rank's shards of the flat parameter buckets (module doc).

    Use it as the optimizer itself: `opt.step()`, `opt.zero_grad()`; `opt.optimizer` is the
    inner one, over the shards' runs."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        options: dict[str, Any],
        *,
        context: StepContext,
        flats: list[list[torch.Tensor]],
        groups: ParameterGroups,
        elementwise: bool = False,
        masters: MasterWeights | None = None,
    ):
        zero = context.buckets[0].zero
        require_elementwise(optimizer_class, elementwise=elementwise, field="zero", value=zero, whole="zero=0",
                            steps="each rank's shard of flat parameter buffers")
        left_out = [n for b in context.buckets for s in b.states for n in s.bucket.parameters if groups.group_of(n) is None]
        if left_out:
            more = f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else ""
            raise PlanError(
                f"plan zero={zero} shards the optimizer over flat buffers of all the trained parameters, so one "
                f"optimizer steps them all and gathers them after its step; its param_groups leave out "
                f"{left_out[0]!r}{more}. Fix: one optimizer whose groups name every trained parameter (options "
                "per group), or zero=0 or 3 for several optimizers",
                field="zero",
                value=zero,
            )
        self.context = context
        self._flats = flats  # per module, per bucket
        self._shards: list[tuple[GradientBuckets, int, torch.Tensor]] = []
        self._runs: list[list[ShardRun]] = []  # per shard
        self._working: list[torch.Tensor | None] = []  # bf16-mixed: each stepped master's bf16 shard
        for module, (buckets, module_flats) in enumerate(zip(context.buckets, flats)):
            dp = buckets.group
            for index, (state, flat) in enumerate(zip(buckets.states, module_flats)):
                shard = flat[state.bucket.shard(dp.size, dp.index)]
                master = masters.shard_of(module, index) if masters else None
                stepped = shard if master is None else master
                self._shards.append((buckets, index, stepped))
                self._runs.append(group_runs(buckets, index, stepped, groups))
                self._working.append(None if master is None else shard)
        # An expert's weights under ep are in no bucket: stepped whole, as plain training does.
        self._whole = [(name, p, masters.master_of(p) if masters else None) for name, p in unbucketed(context)]
        whole = [(groups.group_of(name), p if master is None else master) for name, p, master in self._whole]
        self.optimizer = optimizer_class(groups.torch_groups(
            [*((run.group, run.tensor) for runs in self._runs for run in runs), *whole]), **options)
        self._guard = StepGuard(context.step_program, "optimizer")

    @property
    def whole(self) -> dict[str, torch.Tensor]:
        """The parameters stepped whole beside the shards (an expert's weights under ep), by
        name: what the inner optimizer steps for each (its fp32 master under bf16-mixed)."""
        return {name: p if master is None else master for name, p, master in self._whole}

    @property
    def shards(self) -> list[tuple[GradientBuckets, int, torch.Tensor]]:
        """(buckets, bucket index, this rank's shard of its flat parameters: what the inner
        optimizer steps, in runs of one group, its fp32 master under bf16-mixed) per bucket."""
        return list(self._shards)

    def shard_state(self, position: int) -> dict[str, torch.Tensor]:
        """The inner optimizer's state of `shards[position]`, shaped as the shard: its runs'
        states end to end (a 0-dim state, Adam's `step`, the first run's: they step together)."""
        runs = self._runs[position]
        states = [self.optimizer.state.get(run.tensor, {}) for run in runs]
        if len(runs) == 1:
            return dict(states[0])
        return {key: torch.cat([s[key] for s in states]) if value.dim() else value
                for key, value in states[0].items()}

    def load_shard_state(self, position: int, values: dict[str, torch.Tensor]) -> None:
        """Set state entries of `shards[position]` from tensors shaped as the shard: each run's
        state a view of its part (what is read into `values` later reaches the runs), a 0-dim
        value copied to every run (each run's counter steps on its own)."""
        for run in self._runs[position]:
            state = self.optimizer.state.setdefault(run.tensor, {})
            for key, value in values.items():
                state[key] = value[run.start : run.stop] if value.dim() else value.clone()

    def step(self, closure: Callable | None = None):
        """Step this rank's shards on their reduced gradients, then gather every bucket's
        updated parameters (the step program's optimizer part)."""
        for (buckets, index, shard), runs in zip(self._shards, self._runs):
            gradient = buckets.shard_gradient(index)  # None after zero_grad: torch.optim skips the runs
            if gradient is not None:
                gradient = gradient.to(shard.dtype)  # bf16-mixed's fp32 master, a bf16 reduction
            for run in runs:
                run.tensor.grad = None if gradient is None else gradient[run.start : run.stop]
        for _, parameter, master in self._whole:
            if master is not None:
                master.grad = None if parameter.grad is None else parameter.grad.to(master.dtype)
        loss = self.optimizer.step(closure)
        with torch.no_grad():
            for (_, _, master), working, runs in zip(self._shards, self._working, self._runs):
                if working is not None:  # the master rounded into the bf16 flat bucket
                    working.copy_(master)
                    for run in runs:
                        run.tensor.grad = None
            for _, parameter, master in self._whole:
                if master is not None:
                    parameter.copy_(master)
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
        """Forget the step's gradients: the reduced shards (what a next step would otherwise
        add to: `runtime.step.gradient_accumulation`), the runs' and the parameters' own."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for buckets in self.context.buckets:
            buckets.forget_reduced(set_to_none=set_to_none)
        for module in self.context.modules:
            for parameter in module.parameters():
                if set_to_none:
                    parameter.grad = None
                elif parameter.grad is not None:
                    parameter.grad.zero_()
