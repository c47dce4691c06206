"""Plan checks: a valid plan against the launch and the data.

A `Plan` is valid on its own once built (`Plan.__post_init__`); these checks need something
the plan does not hold, and each raises `PlanError` naming the numbers and a fix:

- `check_world_size`   its degrees against torchrun's WORLD_SIZE, suggesting plans that fit
                       (`fxpar.plan.world`)
- `check_batch`        a global batch against dp x microbatches
- `check_sequence`     a sequence length against tp, under sequence parallelism

`Plan.check_world_size`, `Plan.check_batch` and `Plan.check_sequence` are these functions.
"""

from __future__ import annotations

from typing import Protocol

from fxpar.errors import PlanError, shown
from fxpar.plan.text import is_positive_int
from fxpar.plan.world import plans_for_world


class CheckedPlan(Protocol):
    """What these checks read of a `fxpar.plan.plan.Plan` (which imports this module)."""

    dp: int
    pp: int
    tp: int
    microbatches: int
    schedule: str
    sequence_parallel: bool
    zero: int
    precision: str
    reduce_dtype: str

    @property
    def degrees(self) -> dict[str, int]: ...

    @property
    def world_size(self) -> int: ...


def check_world_size(plan: CheckedPlan, world_size: int) -> None:
    """Raise `PlanError` unless the plan's degrees multiply to `world_size` (torchrun's).

    The message suggests plans that do (`plans_for_world`).
    """
    if not is_positive_int(world_size):
        raise PlanError(
            f"WORLD_SIZE must be a positive integer, got {shown(world_size)}. "
            "Fix: launch with torchrun, which sets it.",
            field="world_size",
            value=world_size,
        )
    if world_size == plan.world_size:
        return
    degrees = " * ".join(
        f"{name}={value}" for name, value in plan.degrees.items() if value > 1 or name == "dp"
    )
    examples = ", or ".join(str(p) for p in plans_for_world(plan, world_size))
    raise PlanError(
        f"plan degrees multiply to {plan.world_size} ({degrees}) but WORLD_SIZE is "
        f"{world_size}. Fix: launch with `torchrun --nproc-per-node {plan.world_size} ...` "
        f"or change the plan so the degrees multiply to {world_size} (for example {examples}).",
        field="world_size",
        value=world_size,
    )


def check_batch(plan: CheckedPlan, batch: int) -> None:
    """Raise `PlanError` unless the global `batch` splits evenly into dp * microbatches parts;
    the message names the nearest batches that do, and the mb or dp that fits this one."""
    if not is_positive_int(batch):
        raise PlanError(
            f"global batch must be a positive integer, got {shown(batch)}. "
            "Fix: pass the number of samples in one step, e.g. 32.",
            field="batch",
            value=batch,
        )
    dp, mb = plan.dp, plan.microbatches
    unit = dp * mb
    if batch % unit == 0:
        return
    below, above = batch // unit * unit, (batch // unit + 1) * unit
    fixes = [f"use a global batch of {f'{below} or {above}' if below else above}"]
    if batch % dp == 0:  # keep dp: the most microbatches that still divide the local batch
        best = max(m for m in range(1, min(mb, batch) + 1) if batch % (dp * m) == 0)
        fixes.append(f"keep the batch and use mb={best}")
    if batch % mb == 0:  # keep mb: the most replicas that still divide the batch
        best = max(d for d in range(1, min(dp, batch) + 1) if batch % (d * mb) == 0)
        fixes.append(f"keep the batch and use dp={best} (and launch that many ranks)")
    raise PlanError(
        f"global batch {batch} is not divisible by dp * microbatches = {dp} * {mb} = {unit}: "
        f"each of the {dp} data-parallel replicas takes batch/dp samples and splits them "
        f"into {mb} equal microbatches. Fix: {', or '.join(fixes)}.",
        field="batch",
        value=batch,
    )


def check_sequence(plan: CheckedPlan, length: int, *, what: str = "the sequence length") -> None:
    """Raise `PlanError` when sequence parallelism cannot split `length` tokens over tp;
    `what` names the length in the message ("the example's sequence length")."""
    if not plan.sequence_parallel or length % plan.tp == 0:
        return
    fits = [n for n in (length - length % plan.tp, length + plan.tp - length % plan.tp) if n > 0]
    raise PlanError(
        f"plan sp=true shards the sequence over tp={plan.tp} ranks, and {what} {length} is "
        f"not divisible by {plan.tp}. Fix: use sequences of {' or '.join(map(str, fits))} "
        "tokens (a multiple of tp), or sp=false",
        field="sequence_parallel",
        value=True,
    )
