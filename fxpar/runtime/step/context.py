"""The step context: everything of the bound rank an executor reads, in one explicit object.

`Runner` builds it once, at bind, after the state is placed and the gradient buckets exist,
and hands it to its executor (`ModuleExecutor`, or `PipelineExecutor` with a pipeline),
which reads nothing of the Runner itself.

    rank, device          the global rank, and where its tensors live
    step_program          what the rank does in a step, in order (`fxpar.ir.step_program`)
    guard                 holds every collective of a step to that program (`guard`)
    modules               the rank's stage modules, in stage order (one without a pipeline)
    forwards              what the executors call for each module: its graph (with its
                          checkpoint regions, `runtime.step.recompute`) reading the module's
                          tensors by flat names (`runtime.flat_reads`)
    module_of_stage       stage index -> its position in `modules`
    buckets               one `GradientBuckets` per module under data parallelism, else none
    partial_gradients     per module and axis ("tp", "cp"), the replicated parameters whose
                          gradient each rank of the axis holds a summand of (summed by a
                          PARTIAL_GRADIENTS action on that axis)
    tied                  tied parameter name -> (this rank's copy, its owners' group)
    loss                  the `StepLoss`: valid-target counts and each microbatch's share
    communicator          every collective and transfer goes through it (counted, logged)
    groups                this rank's process group on each mesh axis
    receives_ahead        how many actions ahead a pipeline posts receives
                          (`pipeline_program.receives_ahead`)
    record_timeline       whether the executor keeps each action's start and end
    random                the step's random stream: executors set the microbatch each compute
                          action is for (`fxpar.ops.random_streams`)
    steps                 how many times `runner.step` was called since bind, this one
                          included: the number the ranks agree on (`runtime.step.agreement`)
    count_arrival         the step's valid-target count while its all-reduce is in flight;
                          the rank's graphs wait for it where they read it (`runtime.step.valid_targets`)
    input_names           the step's inputs as the compile-time example named them, for messages

`receives_ahead` and `record_timeline` are settings, which the Runner's attributes of the same
name change between steps (a new `receives_ahead` comes with its step program and guard);
`steps` is counted by `runner.step`; the rest is fixed at bind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fxpar.runtime.step.valid_targets import CountArrival

if TYPE_CHECKING:
    import torch.fx as fx

    from fxpar.ir.mesh import Axis
    from fxpar.ir.step_program import StepProgram
    from fxpar.ops.random_streams import RandomStream
    from fxpar.runtime.communicator import Communicator
    from fxpar.runtime.process_groups import RankGroup
    from fxpar.runtime.state.gradient_buckets import GradientBuckets
    from fxpar.runtime.state.parameter_gatherer import ParameterGatherer
    from fxpar.runtime.step.guard import StepGuard
    from fxpar.runtime.step.loss import StepLoss
    from fxpar.runtime.step.saved_tensors import SavedTensorMeter


@dataclass(kw_only=True, eq=False)
class StepContext:
    """What an executor needs to run this rank's steps (fields in the module doc)."""

    rank: int
    device: torch.device
    step_program: StepProgram
    guard: StepGuard
    modules: tuple[fx.GraphModule, ...]
    forwards: tuple[Callable, ...]  # what runs each module's forward (`runtime.flat_reads`)
    module_of_stage: Mapping[int, int]
    buckets: tuple[GradientBuckets, ...]
    partial_gradients: tuple[dict[str, list[torch.nn.Parameter]], ...]
    tied: Mapping[str, tuple[torch.nn.Parameter, RankGroup]]
    loss: StepLoss
    communicator: Communicator
    groups: Mapping[Axis, RankGroup]
    receives_ahead: int
    random: RandomStream
    record_timeline: bool = False
    steps: int = 0
    # ZeRO-3's eager gathers per module (`runtime.state.parameter_gatherer`), or () without ZeRO-3.
    gatherers: tuple[ParameterGatherer, ...] = ()

    # The meter of what the step saves for backward (`runtime.step.saved_tensors`), if any.
    meter: SavedTensorMeter | None = None
    # The step's count of valid targets, in flight during the forward (`runtime.step.valid_targets`).
    count_arrival: CountArrival = field(default_factory=CountArrival)
    input_names: tuple[str, ...] = ()

    def land_gradients(self) -> None:
        """After a backward: ZeRO-3's reduce-scatters still in flight complete and give the
        parameters' pieces their gradients (`ParameterGatherer.land`); nothing otherwise."""
        for gatherer in self.gatherers:
            gatherer.land()

    def saving(self, module: int):
        """The context a forward of module `module` runs in (ZeRO-3 packs what autograd saves of
        gathered parameters as recipes, and the meter counts the rest; nothing otherwise)."""
        hooks = self.gatherers[module].hooks() if self.gatherers else None
        if hooks is None:
            return contextlib.nullcontext()
        if self.meter is None:
            return torch.autograd.graph.saved_tensors_hooks(*hooks)
        return self.meter.composed(*hooks)
