"""Tier 1: the search's filters, ranking, report and errors (`fxpar.planner.search`), with a
stand-in cost model so that each rule is seen alone."""

import dataclasses

import pytest

import fxpar
from fxpar.planner.search import VARIANTS_PRICED, Scored, search
from fxpar.planner.space import SearchSpace

MB = 1e6
SPACE = SearchSpace(world_size=4, devices_per_node=8, batch=8)


def toy_price(plan: fxpar.Plan) -> Scored:
    """Faster with more dp, slower with recomputation and each microbatch; ZeRO and pipelines
    cut memory. Not fxpar's cost model: a rule per field, to see the search apply them."""
    recompute = {"none": 0.0, "selective": 0.1, "full": 0.3}[plan.checkpoint]
    seconds = 1.0 / plan.dp + 0.2 * plan.tp + 0.25 * plan.pp + recompute + 0.01 * (plan.microbatches + plan.zero)
    peak = 40 * MB / (plan.tp * plan.pp) / (1 + plan.zero) + 10 * MB * {"none": 1, "selective": 0.7, "full": 0.2}[plan.checkpoint]
    return Scored(plan=plan, seconds=seconds, peak_bytes=peak)


def run(budget, evaluate=toy_price, bound=lambda plan: 0.0, space=SPACE, variant=None):
    calls = []

    def counted(plan):
        calls.append(str(plan))
        return evaluate(plan)

    return search(space, hardware="toy", budget_bytes=budget, bound=bound, evaluate=counted, variant=variant), calls


def test_the_fastest_plan_that_fits_is_chosen_and_the_ranking_is_by_time():
    result, _ = run(budget=None)
    assert str(result.plan) == "dp=4"
    times = [s.seconds for s in result.ranked]
    assert times == sorted(times)
    tight, _ = run(budget=16 * MB)
    assert tight.best.peak_bytes <= 16 * MB and tight.best.seconds > result.best.seconds


def test_plans_the_bound_refuses_are_never_compiled():
    budget = 20 * MB
    result, calls = run(budget, bound=lambda plan: 40 * MB / (plan.tp * plan.pp) / (1 + plan.zero))
    refused = [r for r in result.rejected if r.reason == "memory" and r.bound]
    assert refused and not {r.plan for r in refused} & set(calls)
    assert all(r.peak_bytes > budget for r in refused)


def test_recomputation_and_microbatches_are_not_priced_when_the_plan_without_them_fits():
    result, calls = run(budget=None)
    assert "dp=4 checkpoint=full" not in calls and "dp=4 mb=2" not in calls
    dominated = {r.plan: r.message for r in result.rejected if r.reason == "dominance"}
    assert "'dp=4' fits" in dominated["dp=4 checkpoint=full"]
    # Under a budget that dp=4 misses but dp=4 with full recomputation makes, the latter is priced.
    _, calls = run(budget=44 * MB)
    assert "dp=4 checkpoint=full" in calls


def test_the_fastest_plans_variants_are_priced_through_the_same_filters():
    """`variant` (compiled mode, in `planner.auto`) is priced for the VARIANTS_PRICED fastest
    plans only; a variant its plan's rules refuse, or that misses the budget, is rejected."""
    def compiled(plan):
        if plan.pp > 1:
            raise fxpar.PlanError("plan compile=inductor: not with a pipeline here. Fix: compile=eager",
                                  field="compile", value="inductor")
        return dataclasses.replace(plan, compile="inductor")

    def faster_compiled(plan):
        scored = toy_price(plan)
        if plan.compile == "inductor":
            return Scored(plan=plan, seconds=scored.seconds - 0.05, peak_bytes=scored.peak_bytes + (plan.zero == 0) * MB)
        return scored

    eager, _ = run(budget=None)
    result, calls = run(budget=None, evaluate=faster_compiled, variant=compiled)
    assert str(result.plan) == "dp=4 compile=inductor"
    priced = [c for c in calls if "compile=inductor" in c]
    assert priced == [f"{s.plan} compile=inductor" for s in eager.ranked[:VARIANTS_PRICED] if s.plan.pp == 1]
    # Over a budget that the eager dp=4 meets and its compiled variant (1 MB more) does not:
    budget = eager.best.peak_bytes + 0.5 * MB
    tight, _ = run(budget=budget, evaluate=faster_compiled, variant=compiled)
    assert str(tight.plan) != "dp=4 compile=inductor"
    assert any(r.plan == "dp=4 compile=inductor" and r.reason == "memory" for r in tight.rejected)


def test_plan_rules_refuse_candidates_with_their_own_messages():
    def zero_bubble_refused(plan):
        if plan.schedule == "zb-h1":
            raise fxpar.PlanError("plan schedule=zb-h1 is refused here. Fix: 1f1b", field="schedule", value="zb-h1")
        return toy_price(plan)

    result, _ = run(budget=None, evaluate=zero_bubble_refused)
    refused = [r for r in result.rejected if r.reason == "schedule"]
    assert refused and all("zb-h1" in r.plan for r in refused)
    assert "refused by their schedule" in result.table()


def test_when_nothing_fits_the_error_names_the_least_memory_and_its_plan():
    with pytest.raises(fxpar.PlanError) as caught:
        run(budget=1 * MB, bound=lambda plan: 2.5 * MB / (1 + plan.zero))
    message = str(caught.value)
    assert caught.value.field == "memory_per_device"
    # The bound refused every plan, so the least are compiled to name what they need exactly.
    least = min(toy_price(fxpar.Plan(**f)).peak_bytes for f in SPACE.candidates() if _valid(f))
    assert f"the least a plan needs is {least / MB:.3f} MB" in message
    named = message.split("under '")[1].split("'")[0]
    assert toy_price(fxpar.Plan.parse(named)).peak_bytes == least


def test_when_no_layout_suits_the_model_the_error_says_why_for_each():
    def heads_of_three(plan):
        if plan.tp > 1 or plan.pp > 1 or plan.dp > 1:
            raise fxpar.PlanError(f"tp={plan.tp} does not divide 3 heads. Fix: tp=1", field="tp", value=plan.tp)
        return toy_price(plan)

    with pytest.raises(fxpar.PlanError, match="no plan of 4 ranks suits this model") as caught:
        run(budget=None, evaluate=heads_of_three)
    assert caught.value.field == "world_size" and "does not divide 3 heads" in str(caught.value)


def test_the_table_shows_the_choice_the_fastest_and_why_the_rest_were_left_out():
    result, _ = run(budget=30 * MB, bound=lambda plan: 40 * MB / (plan.tp * plan.pp) / (1 + plan.zero))
    table = result.table(top=3)
    lines = table.splitlines()
    assert lines[1] == f"chosen: {result.plan}"
    assert sum(1 for line in lines if line.strip().startswith(("1 ", "2 ", "3 "))) == 3
    assert "more that fit" in table and "over the memory budget, the nearest:" in table
    assert "MB over" in table and "dominated" in table


def _valid(fields):
    try:
        fxpar.Plan(**fields)
        return True
    except fxpar.PlanError:
        return False


def test_fixed_fields_that_leave_no_candidate_are_named():
    space = SearchSpace(world_size=4, devices_per_node=2, batch=8, fixed={"tp": 4})
    with pytest.raises(fxpar.PlanError, match=r"no layout of 4 ranks \(tp at most 2 .*fixed fields \(tp=4\)"):
        run(budget=None, space=space)
