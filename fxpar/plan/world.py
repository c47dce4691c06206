"""Plans for another world size: the fixes `Plan.check_world_size` suggests.

A plan's degrees multiply to its world size (`dp * pp * tp`). When torchrun launched another
number of ranks the useful fix is a plan that runs on them, so each suggestion is a whole,
valid plan whose degrees multiply to the launched world size, as close to the original as
that world allows:

    >>> from fxpar.plan.plan import Plan
    >>> [str(p) for p in plans_for_world(Plan(dp=4), 2)]
    ['dp=2']
    >>> [str(p) for p in plans_for_world(Plan(pp=2, tp=2, microbatches=2), 2)]
    ['tp=2 mb=2', 'pp=2 mb=2']

The tensor-parallel degree is kept first (it is tied to the model's head counts), then the
pipeline's, and the data-parallel degree takes up the rest. When dp alone absorbs the change
one plan is given, otherwise two to choose between. Fields tied to a degree are adjusted so
that each suggestion is valid (`_with_degrees`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol, TypeVar

from fxpar.errors import PlanError


class _Degrees(Protocol):
    """What this module reads of a `fxpar.plan.plan.Plan` (which imports this module)."""

    dp: int
    pp: int
    tp: int
    microbatches: int
    schedule: str


P = TypeVar("P", bound=_Degrees)


def plans_for_world(plan: P, world_size: int) -> list[P]:
    """Valid plans like `plan` whose degrees multiply to `world_size` (see the module doc)."""
    triples = [(dp, pp, world_size // (dp * pp)) for dp in _divisors(world_size)
               for pp in _divisors(world_size // dp)]

    def distance(triple: tuple[int, int, int]) -> tuple:
        dp, pp, tp = triple
        return (tp != plan.tp, pp != plan.pp, abs(math.log(tp / plan.tp)),
                abs(math.log(pp / plan.pp)), abs(math.log(dp / plan.dp)))

    found: list[P] = []
    for dp, pp, tp in sorted(triples, key=distance):
        candidate = _with_degrees(plan, dp=dp, pp=pp, tp=tp)
        if candidate is not None and candidate not in found:
            found.append(candidate)
    # found is never empty: dp=world_size with pp=tp=1 is always a valid plan.
    dp_alone = (found[0].tp, found[0].pp) == (plan.tp, plan.pp)
    return found[:1] if dp_alone else found[:2]


def _with_degrees(plan: P, *, dp: int, pp: int, tp: int) -> P | None:
    """`plan` with these degrees and the fields tied to them adjusted; None if still invalid.

    A `split` names stage starts for one number of stages (dropped when pp changes), sequence
    parallelism needs tp > 1, the interleaved schedule pp > 1, and a pipeline schedule other
    than GPipe at least pp microbatches (interleaved: a multiple of pp).
    """
    changes: dict[str, object] = {"dp": dp, "pp": pp, "tp": tp}
    if tp == 1:
        changes["sequence_parallel"] = False
    if pp != plan.pp:
        changes["split"] = ()
    if pp == 1 and plan.schedule == "interleaved":
        changes |= {"schedule": "1f1b", "virtual_stages": 1}
    microbatches = plan.microbatches
    if pp > 1 and plan.schedule != "gpipe":
        microbatches = max(microbatches, pp)
    if pp > 1 and plan.schedule == "interleaved":
        microbatches = -(-microbatches // pp) * pp
    try:
        return replace(plan, **changes, microbatches=microbatches)
    except PlanError:
        return None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
