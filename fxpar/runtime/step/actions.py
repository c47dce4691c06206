"""Running a step program: the state one step's actions share, and the collectives the
runtime issues itself (`Communicate` actions), one handler per `Purpose`.

Both executors walk the rank's step program in order (`fxpar.ir.step_program`): compute actions
run the rank's modules (`ModuleExecutor`, `PipelineExecutor`), pipeline `Exchange` actions
post transfers, and every `Communicate` action comes here:

    VALID_TARGETS        the step's count of valid targets, summed over dp, with the ranks'
                         step numbers (`runtime.step.agreement`), where no bucket carries
                         them; started here, waited for where the graph reads it
                         (`runtime.step.valid_targets`)
    STEP_AGREEMENT       the ranks' step numbers on tp, pp (or dp without a count), with the
                         batch's identity on tp and pp (`runtime.step.batch_identity`); started
                         here, settled before the next call that moves data
    GRADIENT_BUCKET      wait for bucket i of stage s (launched by its hooks during backward)
    PARTIAL_GRADIENTS    replicated parameters' partial tp gradients of stage s, summed
    TIED_GRADIENT        a parameter's gradient summed over the pipeline ranks holding it
    PIPELINE_LOSS        the last stage's loss summed over the pipeline
    LOSS                 the loss averaged over dp (dp's divisor, then a sum)

The step guard holds each of these calls, like the graph's own, to the program.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpar.errors import BindError
from fxpar.ir.mesh import Axis
from fxpar.ir.step_program import Communicate, Purpose
from fxpar.runtime.step.agreement import start_agreement
from fxpar.runtime.step.batch_identity import BatchIdentity

if TYPE_CHECKING:
    from fxpar.runtime.process_groups import RankGroup
    from fxpar.runtime.step.context import StepContext


@dataclass
class StepState:
    """What one step's actions hand each other: the microbatches (with the global count once
    it is known), the rank's count, and its loss (summed over microbatches, then reduced)."""

    chunks: list[tuple[torch.Tensor, ...]]
    loss: torch.Tensor
    count: torch.Tensor | None = None
    counted: bool = False  # whether `chunks` carry the count yet
    mean: float | None = None  # the global mean loss, where a bucket carried it
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> loss, until its B

    def inputs(self, context: StepContext, microbatch: int) -> tuple[torch.Tensor, ...]:
        """Microbatch `microbatch`'s inputs, with the step's count of valid targets."""
        if not self.counted:
            self.chunks, self.counted = context.loss.with_count(self.chunks, self.count), True
            if context.meter is not None and self.count is not None:  # a step input, as the batch
                context.meter.exclude(self.chunks[0][-1])
        return self.chunks[microbatch]

    def result(self) -> float:
        return self.mean if self.mean is not None else float(self.loss)


def communicate(action: Communicate, context: StepContext, state: StepState) -> None:
    """Issue the collective `action` stands for (module doc)."""
    purpose, groups = action.purpose, context.groups
    if purpose is Purpose.VALID_TARGETS:  # in flight while the forward runs (`runtime.step.valid_targets`)
        settle = start_agreement(context.communicator, groups[Axis.DP], context.steps,
                                 tag=action.calls[0].tag, device=context.device, count=state.count)
        state.count = context.count_arrival.expect(settle, context.loss.reduction.count_dtype, context.device)
        return
    if purpose is Purpose.STEP_AGREEMENT:  # settled before the next call moves data
        call = action.calls[0]
        batch = BatchIdentity.of(state.chunks, context.device) if call.batch else None
        assert batch is None or batch.block.numel() == call.batch, "the step program sized the batch identity"
        context.communicator.settle_before_data(start_agreement(
            context.communicator, groups[Axis(call.axis)], context.steps, tag=call.tag, device=context.device,
            batch=batch, names=context.input_names))
        return
    context.count_arrival.settle()  # no collective moves the step's data before the steps agree
    if purpose is Purpose.GRADIENT_BUCKET:
        buckets = context.buckets[context.module_of_stage[action.stage]]
        buckets.finish_bucket(action.index)
        if buckets.carry_loss and action.index == len(buckets.states) - 1:
            state.mean = buckets.loss()
    elif purpose is Purpose.PARTIAL_GRADIENTS:
        call = action.calls[0]
        parameters = context.partial_gradients[context.module_of_stage[action.stage]][call.axis]
        sum_gradients(context, [p.grad for p in parameters], groups[Axis(call.axis)], call.tag)
    elif purpose is Purpose.TIED_GRADIENT:
        parameter, group = context.tied[action.name]
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        sum_gradients(context, [parameter.grad], group, f"tied {action.name} gradient")
    elif purpose is Purpose.PIPELINE_LOSS:
        context.communicator.all_reduce_now(state.loss, groups[Axis.PP], tag="pipeline loss", phase="step")
    elif purpose is Purpose.LOSS:  # over dp, then (its tokens' sums) over cp
        call = action.calls[0]
        if call.axis == "dp":
            state.loss /= context.loss.data_parallel_divisor()
        context.communicator.all_reduce_now(state.loss, groups[Axis(call.axis)], tag=call.tag, phase=call.phase)
    else:  # every purpose lowering writes into a step is handled above
        raise BindError(f"a step program's {purpose.value} action has no runtime handler")


def sum_gradients(context: StepContext, grads: list[torch.Tensor | None], group: RankGroup, tag: str) -> None:
    """Sum `grads` over `group` in one flat all-reduce, in place."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    context.communicator.all_reduce_now(flat, group, tag=tag, phase="step")
    for grad, whole in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(whole)
