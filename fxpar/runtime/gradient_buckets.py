"""Data parallelism at run time: bucketed gradient all-reduce that overlaps backward.

For each bucket of the compile-time assignment (`passes.data_parallel`) this keeps one flat
buffer, and each parameter's `.grad` becomes a view into it (DDP's `gradient_as_bucket_view`),
so the all-reduce reads the gradients where autograd left them. A
`register_post_accumulate_grad_hook` on every parameter counts the gradients still missing in
its bucket: each parameter receives one per microbatch, so a bucket of n parameters is
complete after microbatches x n of them, whichever actions deliver them (a pipeline's
backwards, or its deferred weight-gradient actions). When a bucket is complete (and every
earlier bucket has been launched, so all ranks issue the same sequence) its all-reduce starts
asynchronously while backward goes on. The step program's GRADIENT_BUCKET actions, after the
last backward, wait for each (`finish_bucket`) before the optimizer may step.

Averaging is DDP's: divide by the group size, then sum-all-reduce. When each rank's
gradients are already its share of the global mean (the loss divides by the global count of
valid targets: `runtime.step_loss`), `average=False` sums them instead.

The last bucket has one element more: the step's local loss, summed over microbatches. It is
averaged with the gradients, so every rank learns the global-batch mean loss without a
collective of its own (`loss()`). (Not with a pipeline: only the last stage knows the loss,
after the other stages' buckets are long gone; `carry_loss=False` leaves the slot out. A
model with nothing to train has no bucket: its step program all-reduces the loss alone.)
"""

from __future__ import annotations

import torch

from fxpar.errors import CollectiveError
from fxpar.passes.data_parallel import Bucket
from fxpar.runtime.communicator import Communicator, PendingCollective
from fxpar.runtime.process_groups import RankGroup


class _BucketState:
    def __init__(self, bucket: Bucket, parameters: list[torch.nn.Parameter], extra: int):
        self.bucket = bucket
        self.parameters = parameters
        device = parameters[0].device if parameters else torch.device("cpu")
        self.buffer = torch.zeros(bucket.numel + extra, dtype=bucket.dtype, device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in parameters:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(parameters)


class GradientBuckets:
    """Hooks and buffers for one data-parallel group (see module doc)."""

    def __init__(
        self,
        buckets: tuple[Bucket, ...],
        parameters: dict[str, torch.nn.Parameter],
        group: RankGroup,
        communicator: Communicator,
        *,
        carry_loss: bool = True,
        average: bool = True,
    ):
        self.group = group
        self.communicator = communicator
        self.carry_loss = carry_loss
        self.average = average
        extra = 1 if carry_loss else 0
        self.states = [
            _BucketState(b, [parameters[n] for n in b.parameters], extra if i == len(buckets) - 1 else 0)
            for i, b in enumerate(buckets)
        ]
        self._pending: list[PendingCollective] = []  # bucket i's all-reduce, once launched
        self._next = 0
        self._handles = []
        for state in self.states:
            for param, view in zip(state.parameters, state.views):
                self._handles.append(
                    param.register_post_accumulate_grad_hook(self._hook(state, param, view))
                )

    def _hook(self, state: _BucketState, param: torch.nn.Parameter, view: torch.Tensor):
        def gradient_ready(_: torch.Tensor) -> None:
            if param.grad.data_ptr() != view.data_ptr():  # a fresh gradient, not accumulated in place
                view.copy_(param.grad)
                param.grad = view
            state.pending -= 1
            if state.pending == 0:
                self._launch_ready()

        return gradient_ready

    def start_step(self, microbatches: int) -> None:
        """Arm the hooks for a step of `microbatches` backwards, before the first of them."""
        for state in self.states:
            state.pending = microbatches * len(state.parameters)
        self._next = 0
        self._pending.clear()

    def carry(self, loss: torch.Tensor) -> None:
        """Put the step's local loss in the last bucket's extra slot (before the last backward)."""
        if self.carry_loss and self.states:
            self.states[-1].buffer[-1].copy_(loss.detach())

    def _launch_ready(self) -> None:
        while self._next < len(self.states) and self.states[self._next].pending == 0:
            state = self.states[self._next]
            if self.average:
                state.buffer.div_(self.group.size)
            tag = f"gradient bucket {state.bucket.index}"
            if self._next == len(self.states) - 1 and self.carry_loss:
                tag += " + loss"
            self._pending.append(self.communicator.all_reduce(state.buffer, self.group, tag=tag))
            self._next += 1

    def finish_bucket(self, index: int) -> None:
        """Wait for bucket `index`'s all-reduce (launching what is ready first); raise
        CollectiveError naming the parameters that never received a gradient."""
        self._launch_ready()
        if index >= self._next:
            missing = [
                name
                for state in self.states[self._next :]
                if state.pending
                for name, p in zip(state.bucket.parameters, state.parameters)
                if p.grad is None
            ]
            raise CollectiveError(
                f"backward produced no gradient for {missing[:5]} although the graph uses them; "
                f"bucket {index} was never all-reduced. Are they detached or frozen mid-step?"
            )
        self._pending[index].wait()

    def loss(self) -> float:
        """The global-batch mean loss the last bucket carried (after `finish_bucket` of it)."""
        return float(self.states[-1].buffer[-1])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
