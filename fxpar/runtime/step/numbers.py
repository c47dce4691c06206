"""The ranks' step numbers as slots of a summed vector, and the check that they agree.

Each member of a group writes its `runner.step` call number in its own slot and zeros in the
others, so after a sum every member holds every member's number exactly: an all-gather folded
into an all-reduce (`runtime.step.agreement`). The slots travel either in a small vector of
their own (int64) or at the end of a call the step makes anyway, a float32/64 sum all-reduce
(`lowering.ride_agreements`): the communicator appends them, reduces, checks them and
hands back the payload (`Communicator.all_reduce_now`). A float holds a step number exactly
below 2**24 (float32), so riding slots carry the number modulo 2**24: two ranks exactly a
multiple of 16.8 million steps apart would pass.
"""

from __future__ import annotations

import torch

from fxpar.errors import StepMismatchError
from fxpar.runtime.process_groups import RankGroup

FLOAT_PERIOD = 2**24  # float32 holds every integer below this exactly


def slots(group: RankGroup, step: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's vector: `step` in its own slot of the group, zeros elsewhere."""
    number = step % FLOAT_PERIOD if dtype.is_floating_point else step
    return torch.tensor([number if member == group.index else 0 for member in range(group.size)],
                        dtype=dtype, device=device)


def check(group: RankGroup, step: int, summed: torch.Tensor) -> None:
    """Raise StepMismatchError unless every slot of the `summed` vector holds `step`."""
    base = step - step % FLOAT_PERIOD if summed.dtype.is_floating_point else 0  # back from modulo
    steps = [base + int(s) for s in summed.tolist()]
    if any(s != step for s in steps):
        raise StepMismatchError(mismatch_message(group, step, steps))


def mismatch_message(group: RankGroup, step: int, steps: list[int]) -> str:
    """What every rank of `group` says when its members' `steps` differ (`step`: this rank's)."""
    others = sorted({(s, r) for r, s in zip(group.ranks, steps) if s != step})
    behind = ", ".join(f"rank {r} on step {s}" for s, r in others)
    return (
        f"rank {group.rank} is on step {step} (its call #{step} of runner.step since bind), but on "
        f"the {group.name} {behind}: the ranks are on different steps, so this step's collectives "
        "would pair with another step's and mix their data; the step stops before any of it is "
        "used. A rank skipped a step or ran one more (it caught an exception and carried on, or "
        "its data loader gave it a different number of batches). Fix: when a step fails on one "
        "rank, end every rank (let the exception end the worker; torchrun --max-restarts can "
        "restart the job), and give every rank the same number of batches"
    )
