"""The executor without a pipeline: one rank runs its one module on each microbatch in turn.

It walks the rank's step program (`fxpar.compiler.lowering`): F runs the module on a microbatch and
takes the loss's share (`runtime.step.loss`), B runs its backward; the gradient buckets' hooks
start their all-reduces during the last backward, and the GRADIENT_BUCKET actions after it
wait for them (`runtime.step.actions`). Before the last backward, the step's local loss goes
into the last bucket's spare slot, so the bucket all-reduce that averages the gradients also
averages the loss (`runtime.state.gradient_buckets`). Like `PipelineExecutor`, it reads the bound
rank only through its `StepContext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fxpar.ir.step_program import Communicate, Compute
from fxpar.runtime.step.actions import StepState, communicate

if TYPE_CHECKING:
    from fxpar.runtime.step.context import StepContext


class ModuleExecutor:
    def __init__(self, context: StepContext):
        self.context = context
        self.timeline: list[tuple[str, float, float]] = []  # no actions to time without a pipeline

    def run(self, chunks: list[tuple[torch.Tensor, ...]], sizes: dict) -> float:
        """One training step over this rank's microbatches (export's size symbols at `sizes`);
        returns the global-batch mean loss."""
        context, microbatches = self.context, len(chunks)
        module, all_buckets = context.forwards[0], context.buckets
        state = StepState(chunks, torch.zeros((), device=context.device), context.loss.local_count(chunks))
        for buckets in all_buckets:
            buckets.start_step(microbatches, state.count)
        for gatherer in context.gatherers:
            gatherer.start_step(microbatches)
        for action in context.step_program.actions:
            if isinstance(action, Communicate):
                communicate(action, context, state)
            elif not isinstance(action, Compute):
                raise TypeError(f"a single-stage step has no {type(action).__name__} actions")
            elif action.kind == "F":
                with context.saving(0), context.random.at(action.microbatch):
                    output = module(*state.inputs(context, action.microbatch))
                loss = context.loss.share(output, microbatches)
                state.loss += loss.detach()
                state.losses[action.microbatch] = loss
                if action.microbatch == microbatches - 1:
                    for buckets in all_buckets:
                        buckets.carry(state.loss)
            else:
                context.count_arrival.settle()  # the steps agreed before gradients move
                with context.random.at(action.microbatch):  # a recompute draws as its forward did
                    state.losses.pop(action.microbatch).backward()
                context.land_gradients()
        return state.result()
