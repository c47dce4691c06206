"""Step agreement: the ranks of a group prove they are on the same step before it moves data.

A rank that catches an exception and carries on (or calls `runner.step` once more than its
peers) would otherwise have every collective of its next step paired with another step's:
the shapes match, so nothing fails, and the ranks average data of different batches. So the
first collective of every step on each mesh axis (`lowering.step_start_actions`, in the
rank's step program, so `check()`, the cost model and the guard all see it) carries each
member's step number in a slot of its own:

    [count?, step of member 0, step of member 1, ..., batch of member 0?, batch of member 1?, ...]

int64, summed over the group. Each rank writes its step in its slot and zeros in the others,
so after the sum every rank holds every member's step number exactly (a sum of one non-zero
per slot: an all-gather folded into an all-reduce, `runtime.step.numbers`). When they differ,
every rank of the group raises StepMismatchError naming itself, the members and their steps,
before any of the step's data is used. On tp and pp, whose ranks must be given one batch,
each member's block of the batch's identity follows (its fingerprint and sizes,
`runtime.step.batch_identity`): a member given another batch is BatchMismatchError on every rank.

On dp the slots usually need no call of their own: with the count of valid targets in front
they ride at the end of DDP's first gradient bucket (`lowering.ride_agreements`); the
communicator fills in this rank's number and checks the summed slots before the call's data
is used, so a mismatch stops the step before the mixed sum is (`runtime.step.numbers`).
Every extra call a step makes is a sync point with the peers, which DDP does not pay. Where
the agreement keeps its call (tp and pp always, since the batch's identity must be compared
before any call whose size depends on the batch; dp under bf16 or ZeRO), it does not wait
where it starts: the communicator settles it (waits, reads the steps back, compares) just
before the next call that is not an agreement, or at the end of the step
(`Communicator.settle_before_data`); on dp the count's arrival does
(`runtime.step.valid_targets`). So no collective moves data before the ranks agree, except dp's
buckets launched before the first of them is waited for, whose results are never used when
they do not.

A step number counts every call of `runner.step` since bind, the failed ones included (the
runner counts at the top of `step`): a rank whose step raised before its first collective (a
bad batch) and that carries on sends its next step's number, while its peers still wait in
the step it left, so the two are told apart. A rank that skips a call, or makes one more,
is caught the same way.

This is not the random stream's step (`fxpar.ops.random_streams`, `Runner.rng_state`): that one
counts completed steps and comes back from a checkpoint, and it must, since a failed step drew
nothing to resume; here a failed call must count, or the rank that failed would look as if it
were on its peers' step. Both start equal on every rank at bind.

The optimizer's collectives (ZeRO-1/2's gathers, in `opt.step()`) and gathering the full
state happen outside a step and carry no step number: a rank that skips `opt.step()` alone is
not caught here (its next step's first call pairs with a peer's gather of another size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.step import numbers
from fxpar.runtime.step.batch_identity import BatchIdentity


def start_agreement(
    communicator: Communicator, group: RankGroup, step: int, *, tag: str, device: torch.device,
    count: torch.Tensor | None = None, batch: BatchIdentity | None = None, names: Sequence[str] = (),
) -> Callable[[], torch.Tensor | None]:
    """Start all-reducing this rank's `step` (and `count`, summed; and its `batch`'s identity,
    which every member must share, `runtime.step.batch_identity`; `names` name the inputs) over
    `group`; returns what waits for it, raises StepMismatchError unless every member is on
    `step` (then BatchMismatchError unless every member holds this batch), and returns the
    summed count (module doc: who calls it when).

    The vector lives on `device` (NCCL reduces device tensors only); reading the steps back is
    the one host synchronisation it costs."""
    head = 0 if count is None else 1
    parts = [numbers.slots(group, step, dtype=torch.int64, device=device)]
    if count is not None:  # the count stays on the device: no synchronisation for it
        parts.insert(0, count.reshape(1).to(torch.int64))
    if batch is not None:  # this member's block, zeros in the others'
        blocks = torch.zeros(group.size, batch.block.numel(), dtype=torch.int64, device=device)
        blocks[group.index] = batch.block
        parts.append(blocks.reshape(-1))
    vector = torch.cat(parts)
    pending = communicator.all_reduce(vector, group, tag=tag, phase="forward", agreement=True)

    def settle() -> torch.Tensor | None:
        pending.wait()
        numbers.check(group, step, vector[head:head + group.size])
        if batch is not None:
            batch.check(group, vector[head + group.size:], names)
        return None if count is None else vector[0].to(count.dtype).reshape(count.shape)

    return settle
