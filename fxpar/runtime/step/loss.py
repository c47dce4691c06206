"""The step's loss at run time: counting valid targets, and combining the pieces' losses.

Compile decided how a step's pieces (data-parallel ranks x microbatches) make the one-device
loss (`ir.loss_reduction.LossReduction`):

    sums (a mean cross entropy)           each piece computes sum / global count of valid
                                          targets; losses and gradients are summed
    means (any other loss)                each piece computes its own mean; the pieces are
                                          averaged (1/microbatches, then 1/dp)

With `sums`, before the first forward every rank that computes the loss runs the compiled
count module on each of its microbatches and sums the counts over the data-parallel group in
one small all-reduce (its step program's VALID_TARGETS action, `fxpar.compiler.lowering`, which also
carries the ranks' step numbers: `runtime.step.agreement`); each
microbatch then gets that global count as its `valid_targets` input. Where the count rides in
the first gradient bucket instead (`count_rides`: `lowering.ride_agreements`), each microbatch
gets a count of 1, so its loss and gradients are sums, and the buckets divide them by the
global count after the all-reduce (`runtime.state.gradient_buckets`): the one-device division, made
once on the summed gradients instead of on the loss's gradient at the top of backward.
"""

from __future__ import annotations

import torch

from fxpar.ir.loss_reduction import LossReduction
from fxpar.runtime.process_groups import RankGroup


class StepLoss:
    def __init__(
        self,
        reduction: LossReduction,
        *,
        holds_loss: bool,
        data_parallel: RankGroup,
        count_rides: bool = False,
    ):
        self.reduction = reduction
        self.holds_loss = holds_loss
        self.data_parallel = data_parallel
        self.count_rides = count_rides
        self._one: torch.Tensor | None = None  # the count a graph gets where it rides: made once

    @property
    def sums(self) -> bool:
        """Whether pieces' losses and gradients are summed (True) or averaged (False)."""
        return self.reduction.sums

    def local_count(self, chunks: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        """This rank's count of valid targets over its microbatches, or None when the loss
        needs none (a loss of another form, or a rank that does not compute the loss)."""
        if not (self.sums and self.holds_loss):
            return None
        with torch.no_grad():
            counts = [self.reduction.count_module(*chunk) for chunk in chunks]
        return counts[0] if len(counts) == 1 else torch.stack(counts).sum()

    def with_count(self, chunks: list[tuple[torch.Tensor, ...]], count: torch.Tensor | None):
        """Each microbatch's inputs, plus the count its loss divides by where it needs one:
        the step's global count, or 1 where the count rides in a bucket (module doc)."""
        if count is None:
            return chunks
        if self.count_rides:
            if self._one is None or self._one.device != count.device:
                self._one = torch.ones((), dtype=self.reduction.count_dtype, device=count.device)
            count = self._one
        count = count.to(self.reduction.count_dtype)
        return [(*chunk, count) for chunk in chunks]

    def share(self, loss: torch.Tensor, microbatches: int) -> torch.Tensor:
        """A microbatch's contribution to the rank's loss: itself, or 1/microbatches of it."""
        return loss if self.sums or microbatches == 1 else loss / microbatches

    def data_parallel_divisor(self) -> int:
        """What the sum over data-parallel ranks is divided by: 1, or the group's size."""
        return 1 if self.sums else self.data_parallel.size
