"""The step context: everything of the bound rank an executor reads, in one explicit object.

`Runner` builds it once, at bind, after the state is placed and the gradient buckets exist,
and hands it to its executor (`ModuleExecutor`, or `PipelineExecutor` with a pipeline),
which reads nothing of the Runner itself.

    rank, device          the global rank, and where its tensors live
    modules               the rank's stage modules, in stage order (one without a pipeline)
    buckets               one `GradientBuckets` per module under data parallelism, else none
    loss                  the `StepLoss`: valid-target counts and each microbatch's share
    communicator          every collective and transfer goes through it (counted, logged)
    groups                this rank's process group on each mesh axis
    complete_gradients    after the last backward: finish the buckets, sum partial tp and
                          tied gradients (`Runner.complete_gradients`)
    receives_ahead        how many actions ahead a pipeline posts receives
                          (`pipeline_program.receives_ahead`)
    record_timeline       whether the executor keeps each action's start and end

The last two are settings, which the Runner's attributes of the same name change between
steps; the rest is fixed at bind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch.fx as fx

    from fxpar.mesh import Axis
    from fxpar.runtime.communicator import Communicator
    from fxpar.runtime.gradient_buckets import GradientBuckets
    from fxpar.runtime.process_groups import RankGroup
    from fxpar.runtime.step_loss import StepLoss


@dataclass(kw_only=True, eq=False)
class StepContext:
    """What an executor needs to run this rank's steps (fields in the module doc)."""

    rank: int
    device: torch.device
    modules: tuple[fx.GraphModule, ...]
    buckets: tuple[GradientBuckets, ...]
    loss: StepLoss
    communicator: Communicator
    groups: Mapping[Axis, RankGroup]
    complete_gradients: Callable[[], None]
    receives_ahead: int
    record_timeline: bool = False
