"""Data parallelism at run time: bucketed gradient all-reduce that overlaps backward.

For each bucket of the compile-time assignment (`passes.data_parallel`) this keeps one flat
buffer, and each parameter's `.grad` is a view into it (DDP's `gradient_as_bucket_view`), so
the all-reduce reads the gradients where autograd left them. The views are in place before
the step's first backward (`start_step` zeroes the buffer where the optimizer's `zero_grad`
set gradients to None), so autograd accumulates each gradient into its view and no gradient
is allocated and then copied into the bucket (the copy DDP pays in C++). Gradients an earlier
step left (no `zero_grad` in between) are not in the buffer when it is reduced: the runner
sets them aside before the step and adds them after (`runtime.step.gradient_accumulation`). A
`register_post_accumulate_grad_hook` on every parameter counts the gradients still missing in
its bucket: each parameter receives one per microbatch, so a bucket of n parameters is
complete after microbatches x n of them, whichever actions deliver them (a pipeline's
backwards, or its deferred weight-gradient actions). When a bucket is complete (and every
earlier bucket has been launched, so all ranks issue the same sequence) its all-reduce starts
asynchronously while backward goes on. The step program's GRADIENT_BUCKET actions, after the
last backward, wait for each (`finish_bucket`) before the optimizer may step.

Under bf16-mixed the buffers are bf16, as the gradients (2P); a bucket whose
`Bucket.reduce_dtype` is fp32 is copied into an fp32 buffer of its own for its reduction
(FSDP2's `reduce_dtype`: the sum and the divisor in fp32), which DDP rounds back into the
bucket once and ZeRO keeps as the fp32 reduced shard its optimizer steps on. One bucket's
fp32 copy lives only while it is reduced.

Averaging is DDP's: divide by the group size, then sum-all-reduce. When each rank's
gradients are already its share of the global mean (the loss divides by the global count of
valid targets: `runtime.step.loss`), `average=False` sums them instead.

Each bucket's buffer is laid out as its all-reduce in the step program (`lowering`):

    [ gradients | loss? | count? | step numbers? ]

The last bucket has one element more, the step's local loss summed over microbatches. It is
averaged (or summed) with the gradients, so every rank learns the global-batch mean loss
without a collective of its own (`loss()`). (Not with a pipeline: only the last stage knows
the loss, after the other stages' buckets are long gone; nor under bf16. A model with nothing
to train has no bucket: its step program all-reduces the loss alone.)

The first bucket to launch may carry dp's step agreement (`lowering.ride_agreements`): the
communicator writes this rank's step number into the last slots and checks the sums when
the bucket is waited for, before its gradients are used (`Communicator.all_reduce`). With
it may ride the rank's count of valid targets (`riding_count`): the graphs were then given a
count of 1, so each rank's gradients and loss are sums, and every bucket is divided by the
global count after its sum (`finish_bucket`), as the one-device loss divides its sum.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fxpar.errors import CollectiveError
from fxpar.ir.buckets import Bucket
from fxpar.ir.step_program import Call
from fxpar.passes.data_parallel import carries_loss
from fxpar.runtime.communicator import Communicator, PendingCollective
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.step import riding_count


class _BucketState:
    def __init__(self, bucket: Bucket, parameters: list[torch.nn.Parameter], calls: list[Call], *,
                 loss: bool, padded: int | None, shard: slice | None, lazy: bool):
        self.bucket = bucket
        self.parameters = parameters
        self.device = parameters[0].device if parameters else torch.device("cpu")
        # Its reductions in the step program (one, or one per microbatch): their tags and the
        # slots riding (none where an edited program dropped it: the guard then refuses the
        # call, `runtime.step.guard`).
        self.tags = [c.tag for c in calls] or [f"gradient bucket {bucket.index}"]
        slots, agreement = (calls[0].count, calls[0].agreement) if calls else (0, 0)
        self.count_at = bucket.numel + loss  # the gradients and the loss end here
        self.count = slice(self.count_at, self.count_at + slots) if slots else None  # its digits
        # Elements of the flat buffer: the gradients and the slots (module doc), or ZeRO's padding.
        self.size = padded if padded is not None else self.count_at + slots + agreement
        self.shard = shard  # ZeRO: this rank's elements of the buffer, else None
        self.reduced: torch.Tensor | None = None  # ZeRO: the reduced gradient shard
        self.incoming: torch.Tensor | None = None  # a later microbatch's shard, added to `reduced`
        self.rounds = 1  # reductions a step (ZeRO-2 per microbatch: one per microbatch)
        self.round = 0  # reductions launched this step
        self.staged: torch.Tensor | None = None  # the buffer in `reduce_dtype`, while reduced
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if not lazy:  # ZeRO-2's buffer exists only from its first gradient to its reduction
            self.allocate()
        self.pending = len(parameters)
        self.arrived = [0] * len(parameters)  # gradients each parameter got this step

    def point_gradients_at_views(self) -> None:
        """Make every parameter's `.grad` its view, zeroed where it had none, so backward
        accumulates into the bucket (a gradient the user set to another tensor is copied in
        by the hook instead)."""
        if all(p.grad is None for p in self.parameters):
            self.buffer.zero_()  # one fill for the bucket (its loss slot is written later)
            for p, view in zip(self.parameters, self.views):
                p.grad = view
            return
        for p, view in zip(self.parameters, self.views):
            if p.grad is None:
                p.grad = view.zero_()

    def allocate(self) -> None:
        """The flat buffer the parameters' gradients accumulate in, and their views into it."""
        self.buffer = torch.zeros(self.size, dtype=self.bucket.dtype, device=self.device)
        self.views, offset = [], 0
        for p in self.parameters:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class GradientBuckets:
    """Hooks and buffers for one data-parallel group (see module doc).

    `zero` (ZeRO-1/2, Rajbhandari et al. 2020): each bucket's buffer is padded to a multiple
    of the group size (`Bucket.padded`) and reduce-scattered, so each rank gets the reduced
    shard its optimizer-state shard needs (`shard_gradient`): under ZeRO-1 into the buffer's
    own shard (the rest keeps this rank's unreduced gradients, 4P bytes in all), under ZeRO-2
    into a shard of its own (4P/N held). ZeRO-2's whole buffer exists only while the step
    needs it: allocated when the bucket's first gradient arrives in backward (autograd's
    gradient is copied in, as DDP copies), freed once the bucket is reduced, so the whole
    gradients never sit beside the forward's activations of a one-microbatch step; with
    several microbatches they accumulate over the step's backwards, and are kept while the
    later microbatches' activations are (`cost.memory.peak_bytes` prices both), unless the
    buckets reduce per microbatch (`per_microbatch`, `fxpar.plan.zero_reduction`): then each
    microbatch's whole gradients are reduce-scattered after its backward and freed, and its
    shard is added to the step's. A held bucket (`Bucket.held`) waits for its step-end sum
    and goes out in `finish_bucket`, once per step.
    """

    def __init__(
        self,
        buckets: tuple[Bucket, ...],
        parameters: dict[str, torch.nn.Parameter],
        group: RankGroup,
        communicator: Communicator,
        calls: Mapping[int, list[Call]],
        *,
        carry_loss: bool = True,
        average: bool = True,
        zero: int = 0,
        per_microbatch: bool = False,
    ):
        """`calls`: each bucket's reductions in the rank's step program, by bucket index;
        `per_microbatch`: ZeRO-2 reduce-scatters each microbatch's gradients (class doc)."""
        self.group = group
        self.communicator = communicator
        self.carry_loss = carry_loss and zero == 0 and carries_loss(buckets)
        self.average = average
        self.zero = zero
        self.per_microbatch = per_microbatch and zero == 2
        self.states = [
            _BucketState(b, [parameters[n] for n in b.parameters], calls.get(b.index, []),
                         loss=self.carry_loss and i == len(buckets) - 1,
                         padded=b.padded(group.size) if zero else None,
                         shard=b.shard(group.size, group.index) if zero else None, lazy=zero == 2)
            for i, b in enumerate(buckets)
        ]
        self.counted = any(s.count is not None for s in self.states)  # the count rides: divide by it
        self._local_count: torch.Tensor | None = None
        self._count: torch.Tensor | None = None  # the global count, once its bucket is reduced
        self._hooked = [i for i, s in enumerate(self.states) if not s.bucket.held]  # launch order
        self._pending: dict[int, PendingCollective] = {}  # bucket index -> its reduction
        self._next = 0  # into `_hooked`
        self._handles = []
        for state in self.states:
            for position, param in enumerate(state.parameters):
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(state, position)))

    def _hook(self, state: _BucketState, position: int):
        param = state.parameters[position]

        def gradient_ready(_: torch.Tensor) -> None:
            if state.buffer is None:  # ZeRO-2: the bucket's first gradient of the step
                state.allocate()
            view = state.views[position]  # (ZeRO-2 makes new views each step)
            if param.grad is not view:  # a tensor of the user's, not accumulated in the bucket
                view.copy_(param.grad)
                param.grad = view
            state.arrived[position] += 1
            state.pending -= 1
            if state.pending == 0:
                self._launch_ready()

        return gradient_ready

    def start_step(self, microbatches: int, count: torch.Tensor | None = None) -> None:
        """Arm the hooks for a step of `microbatches` backwards, before the first of them;
        `count`: this rank's count of valid targets, where it rides in a bucket."""
        if self.counted and count is None:
            raise CollectiveError("the step program has the count of valid targets ride in a gradient "
                                  "bucket, but the step gave none; this is an fxpar bug")
        self._local_count, self._count = count, None
        for state in self.states:
            each = self.per_microbatch and not state.bucket.held  # a held bucket waits for its sums
            state.rounds, state.round = (microbatches, 0) if each else (1, 0)
            state.pending = microbatches // state.rounds * len(state.parameters)
            state.arrived = [0] * len(state.parameters)
            if state.buffer is not None:  # ZeRO-2 allocates it at its first gradient (class doc)
                state.point_gradients_at_views()
        self._next = 0
        self._pending.clear()

    def carry(self, loss: torch.Tensor) -> None:
        """Put the step's local loss in the last bucket's extra slot (before the last backward)."""
        if self.carry_loss:
            state = self.states[-1]
            state.buffer[state.bucket.numel].copy_(loss.detach())

    def _launch_ready(self) -> None:
        while self._next < len(self._hooked) and self.states[self._hooked[self._next]].pending == 0:
            self._launch(self._hooked[self._next])
            self._next += 1
            first = self.states[self._hooked[0]]
            if self._next == len(self._hooked) and first.round < first.rounds:
                self._next = 0  # per microbatch: the next microbatch launches them again, in order

    def _launch(self, index: int) -> None:
        state = self.states[index]
        state.round += 1
        if state.round < state.rounds:  # armed for the next microbatch's gradients
            state.pending = len(state.parameters)
        wire = state.buffer
        if state.bucket.reduce_dtype is not None:  # e.g. bf16 gradients summed in fp32
            wire = state.staged = state.buffer.to(state.bucket.reduce_dtype)
        if self.average:
            wire.div_(self.group.size)
        tag = state.tags[min(state.round, len(state.tags)) - 1]
        if not self.zero:
            if state.count is not None:  # after the division: the count is summed, not averaged
                slots = state.count.stop - state.count.start
                wire[state.count] = riding_count.digits(self._local_count, slots, wire.dtype)
            # The step numbers' slots, if any, are the communicator's to fill and check.
            self._pending[index] = self.communicator.all_reduce(wire, self.group, tag=tag)
            return
        if self.zero == 1 and wire is state.buffer:
            state.reduced = state.buffer[state.shard]
        elif state.reduced is None:
            state.reduced = wire.new_empty(state.shard.stop - state.shard.start)
        out = state.reduced
        if state.round > 1:  # a later microbatch's: summed into the shard once it arrives
            out = state.incoming = torch.empty_like(state.reduced)
        self._pending[index] = self.communicator.reduce_scatter(out, wire, self.group, tag=tag)

    def finish_bucket(self, index: int) -> None:
        """Wait for bucket `index`'s reduction (launching what is ready first, and a held
        bucket now); raise CollectiveError naming the parameters that never got a gradient."""
        self._launch_ready()
        state = self.states[index]
        if index not in self._pending and state.bucket.held and state.pending == 0:
            self._launch(index)
        if index not in self._pending:
            missing = [
                name
                for s in self.states if s.pending
                for name, arrived in zip(s.bucket.parameters, s.arrived)
                if not arrived
            ]
            raise CollectiveError(
                f"backward produced no gradient for {missing[:5]} although the graph uses them; "
                f"bucket {index} was never reduced. Are they detached or frozen mid-step?"
            )
        self._pending.pop(index).wait()  # raises StepMismatchError if a step agreement rode along
        if state.incoming is not None:  # ZeRO-2 per microbatch: the shards' sum over microbatches
            state.reduced.add_(state.incoming)
            state.incoming = None
        wire = state.staged if state.staged is not None else state.buffer  # what was reduced
        if state.count is not None:
            self._count = riding_count.number(wire, state.count.start, state.count.stop)
        if self.counted:  # the sums become the one-device mean (module doc)
            if self._count is None:
                raise CollectiveError(f"gradient bucket {index} was reduced before the one that carries "
                                      "the count of valid targets; this is an fxpar bug")
            wire[: state.count_at].div_(self._count.to(wire.dtype))  # the gradients and the loss
        if state.staged is not None:  # the sum, rounded once into the bucket (DDP)
            if not self.zero:
                state.buffer.copy_(state.staged)
            state.staged = None
        if self.zero == 2:  # only the shard is kept: the whole gradients go (ZeRO-2)
            for param in state.parameters:
                param.grad = None
            state.buffer, state.views = None, []

    def shard_spans(self, index: int):
        """ZeRO-1/2: (name, parameter, first element in the parameter, start and stop in the
        shard) of each parameter this rank's shard of bucket `index` overlaps (`Bucket.shard`,
        the flat layout of `sharded_optimizer.flatten_parameters`)."""
        state = self.states[index]
        shard = state.bucket.shard(self.group.size, self.group.index)
        offset = 0
        for name, parameter in zip(state.bucket.parameters, state.parameters):
            start, stop = max(shard.start, offset), min(shard.stop, offset + parameter.numel())
            if start < stop:
                yield name, parameter, start - offset, start - shard.start, stop - shard.start
            offset += parameter.numel()

    def shard_gradient(self, index: int) -> torch.Tensor | None:
        """ZeRO: this rank's shard of bucket `index`'s reduced gradient (after `finish_bucket`),
        None before the first step and after `forget_reduced`."""
        return self.states[index].reduced

    def forget_reduced(self, *, set_to_none: bool) -> None:
        """ZeRO: drop the reduced shards (or zero them in place), as `zero_grad` drops `.grad`:
        the shard is the gradient the optimizer steps, and what the next step would add its
        own to (`runtime.step.gradient_accumulation`)."""
        for state in self.states:
            if set_to_none:
                state.reduced = None
            elif state.reduced is not None:
                state.reduced.zero_()

    def whole_gradients(
        self, index: int, *, tag: str, shard: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """ZeRO: bucket `index`'s reduced gradient (or another `shard` laid out as it, such as
        an optimizer's state) gathered whole over dp, by parameter name (zeros before the first
        step), in `dtype` if given (the full state's: fp32 masters' under bf16-mixed); outside
        a step (not in the step's log)."""
        state = self.states[index]
        shard = state.reduced if shard is None else shard
        if shard is None:
            shard = torch.zeros(state.size // self.group.size, dtype=state.bucket.reduced_dtype, device=state.device)
        if dtype is not None:
            shard = shard.to(dtype)
        flat = shard.new_empty(state.size)
        self.communicator.all_gather_now(flat, shard, self.group, tag=tag, phase="step", log=False)
        pieces = flat[: state.bucket.numel].split([p.numel() for p in state.parameters])
        return {name: piece.view_as(p) for name, piece, p in zip(state.bucket.parameters, pieces, state.parameters)}

    def loss(self) -> float:
        """The global-batch mean loss the last bucket carried (after `finish_bucket` of it)."""
        state = self.states[-1]
        return float(state.buffer[state.bucket.numel])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
