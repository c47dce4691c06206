"""The search behind `plan="auto"`: every candidate of a `SearchSpace`, priced, the fastest
that fits chosen, and every other one accounted for.

Each candidate passes four filters, cheapest first, and the first that refuses it says why:

    the plan's own rules   `Plan(**fields)` (a schedule's microbatches, an option that needs
                           another): the PlanError's message
    dominance              the same plan with less recomputation or (without a pipeline) fewer
                           microbatches already fits: it is at least as fast
                           (`space.memory_trade`), so this one is never the choice
    a memory bound         the bytes every plan of its layout holds at least (the worst rank's
                           weights and optimizer state: `bound`), against the budget; it never
                           refuses a plan that would fit, and spares the compile of one that
                           cannot
    the cost model         the plan compiled from the one capture and estimated (`evaluate`:
                           `program.estimate()`, the numbers `fxpar estimate` prints); its
                           PlanError (heads that tp does not divide, too few blocks for the
                           stages) or its predicted peak over the budget

The survivors are ranked by predicted step time, then peak memory. Given a `variant` (a plan
to price beside each of the fastest: `compile=inductor`, where the hardware's profile says
compiling pays), the `VARIANTS_PRICED` fastest survivors' variants are priced too, through
the same filters, and ranked with the rest. This module knows nothing of how a plan is
compiled or priced: the caller passes `bound`, `evaluate` and `variant`
(`fxpar.compiler.program.plan_auto`), so the search is the same whatever the cost model is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fxpar.cost.estimate import si
from fxpar.errors import PlanError
from fxpar.plan.plan import Plan
from fxpar.plan.text import FIELDS, text_of
from fxpar.planner.space import SearchSpace, memory_trade

FILLED_IN_WHEN_NOTHING_FITS = 8  # plans refused by the bound, compiled to name the least peak
# Survivors whose `variant` is priced too: a compiled variant costs a partition of each of its
# distinct modules by Inductor (seconds), and the layouts that lead eager mode lead compiled.
VARIANTS_PRICED = 4


@dataclass(frozen=True, kw_only=True)
class Scored:
    """A candidate the cost model priced: its predicted step time and worst rank's peak."""

    plan: Plan
    seconds: float
    peak_bytes: float
    estimate: object = None  # the `fxpar.cost.estimate.Estimate` behind the numbers


@dataclass(frozen=True, kw_only=True)
class Rejected:
    """A candidate left out, with the rule that left it out.

    `reason` is "memory" (predicted peak over the budget; `peak_bytes` says by how much, and
    `bound` whether it is the lower bound rather than the estimate), "dominance" (a plan that
    fits is at least as fast: `message` names it) or the plan field whose PlanError refused it
    (`message` is the error)."""

    plan: str
    reason: str
    message: str
    peak_bytes: float | None = None
    bound: bool = False


@dataclass(frozen=True, kw_only=True)
class PlanSearch:
    """The outcome of a search: every candidate ranked or rejected."""

    world_size: int
    hardware: str
    budget_bytes: float | None
    ranked: tuple[Scored, ...]  # fastest first
    rejected: tuple[Rejected, ...]
    seconds: float  # the search's own wall time

    @property
    def best(self) -> Scored:
        return self.ranked[0]

    @property
    def plan(self) -> Plan:
        """The chosen plan."""
        return self.best.plan

    def table(self, top: int = 10, examples: int = 3) -> str:
        """The chosen plan, the `top` fastest with their predicted time and memory, and for
        the rest which rule rejected them (with `examples` of each, memory by how much)."""
        budget = "no memory limit" if self.budget_bytes is None else f"{si(self.budget_bytes, 'B')} each"
        lines = [
            (f"fxpar plan: {self.world_size} ranks of {self.hardware}, {budget}; "
             f"{len(self.ranked) + len(self.rejected)} candidates, {len(self.ranked)} fit "
             f"(searched in {self.seconds:.1f} s)"),
            f"chosen: {self.plan}",
            f"  {'#':>3}  {'plan':<58}{'step time':>12}{'peak memory':>14}",
        ]
        for i, scored in enumerate(self.ranked[:top], 1):
            lines.append(f"  {i:>3}  {scored.plan!s:<58}{si(scored.seconds, 's'):>12}"
                         f"{si(scored.peak_bytes, 'B'):>14}")
        if len(self.ranked) > top:
            lines.append(f"  ... {len(self.ranked) - top} more that fit")
        groups: dict[str, list[Rejected]] = {}
        for rejected in self.rejected:
            groups.setdefault(rejected.reason, []).append(rejected)
        if groups:
            lines.append("rejected:")
        for reason, members in sorted(groups.items(), key=lambda item: -len(item[1])):
            if reason == "memory":
                members = sorted(members, key=lambda r: r.peak_bytes)
                lines.append(f"  {len(members)} over the memory budget, the nearest:")
                for r in members[:examples]:
                    over = r.peak_bytes - self.budget_bytes
                    at_least = "at least " if r.bound else ""
                    lines.append(f"    {r.plan}: needs {at_least}{si(r.peak_bytes, 'B')}, {si(over, 'B')} over")
            elif reason == "dominance":
                lines.append(f"  {len(members)} dominated, e.g. {members[0].plan}: {members[0].message}")
            else:
                lines.append(f"  {len(members)} refused by their {reason}, e.g. {members[0].plan}: "
                             f"{_first_sentence(members[0].message)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def search(
    space: SearchSpace,
    *,
    hardware: str,
    budget_bytes: float | None,
    bound: Callable[[Plan], float],
    evaluate: Callable[[Plan], Scored],
    variant: Callable[[Plan], Plan] | None = None,
) -> PlanSearch:
    """Every candidate of `space` filtered and ranked, and the fastest ones' `variant`s
    (module doc); a PlanError when none fits, naming the least memory a candidate needs and
    that candidate."""
    started = time.perf_counter()
    ranked: list[Scored] = []
    rejected: list[Rejected] = []
    bounded: list[tuple[float, Plan]] = []  # refused by the bound, kept to fill in if none fits
    fitting: dict[tuple, list[tuple[tuple[int, ...], Plan]]] = {}  # memory_trade's parts that fit
    for fields in space.candidates():
        try:
            plan = Plan(**fields)
        except PlanError as error:
            rejected.append(_refused(_text(fields), error))
            continue
        rest, traded = memory_trade(fields)
        if faster := next((p for t, p in fitting.get(rest, ()) if all(map(int.__le__, t, traded))), None):
            rejected.append(Rejected(plan=str(plan), reason="dominance", message=(
                f"'{faster}' fits with less recomputation or fewer microbatches, and is at least as fast")))
            continue
        if refused := _over_bound(plan, bound, budget_bytes):
            rejected.append(refused)
            bounded.append((refused.peak_bytes, plan))
            continue
        outcome = _priced(plan, evaluate, budget_bytes)
        (ranked if isinstance(outcome, Scored) else rejected).append(outcome)
        if isinstance(outcome, Scored):
            fitting.setdefault(rest, []).append((traded, plan))
    if not ranked:
        # Compile the plans the bound refused with the least state, so the error can name what
        # the smallest plan needs, not just a bound.
        for _, plan in sorted(bounded, key=lambda entry: entry[0])[:FILLED_IN_WHEN_NOTHING_FITS]:
            outcome = _priced(plan, evaluate, budget_bytes)
            if isinstance(outcome, Rejected) and outcome.reason == "memory":
                rejected = [r for r in rejected if r.plan != outcome.plan] + [outcome]
        raise _nothing_fits(space, budget_bytes, rejected)
    ranked.sort(key=lambda s: (s.seconds, s.peak_bytes))
    if variant is not None:
        for outcome in _variants(ranked[:VARIANTS_PRICED], variant, bound, evaluate, budget_bytes):
            (ranked if isinstance(outcome, Scored) else rejected).append(outcome)
        ranked.sort(key=lambda s: (s.seconds, s.peak_bytes))
    return PlanSearch(world_size=space.world_size, hardware=hardware, budget_bytes=budget_bytes,
                      ranked=tuple(ranked), rejected=tuple(rejected),
                      seconds=time.perf_counter() - started)


def _variants(fastest: list[Scored], variant: Callable[[Plan], Plan], bound: Callable[[Plan], float],
              evaluate: Callable[[Plan], Scored], budget_bytes: float | None) -> list[Scored | Rejected]:
    """The `variant` of each of the `fastest`, through the filters a candidate passes: its
    plan's rules, the memory bound, the cost model (a variant has its own activations)."""
    outcomes = []
    for scored in fastest:
        try:
            plan = variant(scored.plan)
        except PlanError as error:
            outcomes.append(_refused(f"{scored.plan} (its variant)", error))
            continue
        outcomes.append(_over_bound(plan, bound, budget_bytes) or _priced(plan, evaluate, budget_bytes))
    return outcomes


def _over_bound(plan: Plan, bound: Callable[[Plan], float], budget_bytes: float | None) -> Rejected | None:
    """`plan` refused by the memory bound, or None where the bound leaves it to be priced."""
    if budget_bytes is None or (least := bound(plan)) <= budget_bytes:
        return None
    return Rejected(plan=str(plan), reason="memory", peak_bytes=least, bound=True,
                    message=f"holds at least {si(least, 'B')} of model state")


def _priced(plan: Plan, evaluate: Callable[[Plan], Scored], budget_bytes: float | None) -> Scored | Rejected:
    try:
        scored = evaluate(plan)
    except PlanError as error:
        return _refused(str(plan), error)
    if budget_bytes is not None and scored.peak_bytes > budget_bytes:
        return Rejected(plan=str(plan), reason="memory", peak_bytes=scored.peak_bytes,
                        message=f"predicted peak {si(scored.peak_bytes, 'B')}")
    return scored


def _refused(plan: str, error: PlanError) -> Rejected:
    return Rejected(plan=plan, reason=error.field or "plan", message=str(error))


def _nothing_fits(space: SearchSpace, budget_bytes: float | None, rejected: list[Rejected]) -> PlanError:
    over = [r for r in rejected if r.reason == "memory"]
    if not rejected:
        fixed = " ".join(f"{FIELDS[k][0]}={text_of(v)}" for k, v in space.fixed.items()) or "none"
        return PlanError(
            f"plan auto: no layout of {space.world_size} ranks (tp at most {space.devices_per_node} "
            f"devices per node) splits the batch of {space.batch} under the fixed fields ({fixed}). "
            "Fix: fix fewer fields, or a batch or world size that divide each other",
            field="world_size", value=space.world_size)
    if not over:
        reasons = sorted({f"{r.reason}: {_first_sentence(r.message)}" for r in rejected})
        return PlanError(
            f"plan auto: no plan of {space.world_size} ranks suits this model and batch "
            f"(batch {space.batch}); every candidate was refused: " + "; ".join(reasons[:6])
            + (f"; and {len(reasons) - 6} more reasons" if len(reasons) > 6 else "")
            + ". Fix: a world size whose factors divide the batch and the model's heads and "
            "blocks, or a batch that the world size divides",
            field="world_size", value=space.world_size)
    least = min(over, key=lambda r: (r.bound, r.peak_bytes))  # an estimate before a bound
    at_least = "at least " if least.bound else ""
    return PlanError(
        f"plan auto: no plan of {space.world_size} ranks fits {si(budget_bytes, 'B')} per device; "
        f"the least a plan needs is {at_least}{si(least.peak_bytes, 'B')}, under '{least.plan}'. "
        f"Fix: memory_per_device of {at_least}{si(least.peak_bytes, 'B')}, more devices, or a "
        "smaller batch",
        field="memory_per_device", value=budget_bytes)


def _text(fields: dict[str, object]) -> str:
    """A candidate's fields in the plan's text form, for one that is not a valid Plan."""
    return " ".join(f"{FIELDS[name][0]}={text_of(value)}" for name, value in fields.items())


def _first_sentence(message: str) -> str:
    return message.split(". Fix")[0]

