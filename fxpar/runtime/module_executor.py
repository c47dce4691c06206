"""The executor without a pipeline: one rank runs its one module on each microbatch in turn.

For each microbatch: forward, the loss's share (`runtime.step_loss`), backward. The gradient
buckets' hooks start their all-reduces during the last backward; before it, the step's local
loss goes into the last bucket's spare slot, so the bucket all-reduce that averages the
gradients also averages the loss (`runtime.gradient_buckets`). Like `PipelineExecutor`, it
reads the bound rank only through its `StepContext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fxpar.runtime.step_context import StepContext


class ModuleExecutor:
    def __init__(self, context: StepContext):
        self.context = context
        self.timeline: list[tuple[str, float, float]] = []  # no actions to time without a pipeline

    def run(self, chunks: list[tuple[torch.Tensor, ...]]) -> float:
        """One training step over this rank's microbatches; returns the global-batch mean loss."""
        context, microbatches = self.context, len(chunks)
        module, all_buckets = context.modules[0], context.buckets
        total = torch.zeros((), device=context.device)
        for buckets in all_buckets:
            buckets.start_step(microbatches)
        for i, chunk in enumerate(chunks):
            loss = context.loss.share(module(*chunk), microbatches)
            total += loss.detach()
            if i == microbatches - 1:
                for buckets in all_buckets:
                    buckets.carry(total)
            loss.backward()
        mean = all_buckets[0].finish() if all_buckets else float(total)  # they carry the loss
        context.complete_gradients()  # finishes the buckets' all-reduces (again: a no-op)
        return mean
