"""Tier 2: `fxpar.plan_auto` and `fxpar.compile(model, "auto")` on the example GPT, every
candidate priced by fxpar's own cost model (`program.estimate()` on the h100 profile)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.cost.profiles import hardware_profile
from fxpar.plan.plan import Plan
from fxpar.planner.search import VARIANTS_PRICED

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

AMPLE = "80GB"


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    return fxpar.capture(GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)),
                         (tokens, torch.roll(tokens, -1, 1)))


@pytest.fixture(scope="module")
def ample(captured):
    return fxpar.plan_auto(captured, world_size=2, hardware="h100", memory_per_device=AMPLE)


def estimate(captured, plan):
    return fxpar.compile(captured, plan, hardware="h100").estimate(hardware_profile("h100", measured=False))


def test_a_model_that_fits_with_room_gets_pure_data_parallelism(ample):
    """Compiled by Inductor: on h100 compiling pays (`Hardware.compile_pays`), so the fastest
    plans' compiled variants are priced too, and run fewer kernels than eager mode's ops."""
    assert ample.plan == Plan(dp=2, compile="inductor")
    assert ample.table().splitlines()[1] == "chosen: dp=2 compile=inductor"
    eager = [s for s in ample.ranked if s.plan.compile == "eager"]
    assert eager[0].plan == Plan(dp=2) and ample.best.seconds < eager[0].seconds
    compiled = sorted(str(s.plan) for s in ample.ranked if s.plan.compile == "inductor")
    assert compiled == sorted(str(dataclasses.replace(s.plan, compile="inductor")) for s in eager[:VARIANTS_PRICED])


def test_on_the_cpu_compiled_mode_is_searched_only_when_fixed(captured):
    """A compiled step on this CPU takes what an eager one does and compiling takes minutes
    (`Hardware.compile_pays` is False): the cpu profile's search prices no compiled plan."""
    search = fxpar.plan_auto(captured, world_size=2, hardware="cpu", measured=False, memory_per_device=AMPLE,
                             fixed="tp=1 pp=1 checkpoint=none")
    assert search.ranked and all(s.plan.compile == "eager" for s in search.ranked)


def test_each_candidate_is_ranked_by_its_own_estimate(captured, ample):
    """The planner is not a second cost model: its numbers are `program.estimate()`'s."""
    for scored in ample.ranked[:3]:
        predicted = estimate(captured, scored.plan)
        assert (predicted.time["total"], predicted.memory["total"]) == (scored.seconds, scored.peak_bytes)


def test_the_plans_left_out_as_dominated_are_no_faster_on_the_cost_model(captured, ample):
    """The claim that spares pricing them (`planner.space.memory_trade`), held on this model's
    plans: more recomputation or (without a pipeline) more microbatches never gains time."""
    dominated = [r for r in ample.rejected if r.reason == "dominance"]
    assert len(dominated) > 20
    for rejected in dominated[::len(dominated) // 6]:
        faster = rejected.message.split("'")[1]
        assert estimate(captured, rejected.plan).time["total"] >= estimate(captured, faster).time["total"], rejected


def test_as_the_budget_tightens_it_trades_time_for_memory_zero_first(captured, ample):
    """Budgets of 90%, 50% and 30% of what pure data parallelism needs: every choice fits its
    budget and none is faster than the last; ZeRO comes first (it costs least time), then
    recomputation, pipelining or ZeRO-3; when nothing fits, the error names the least memory a
    plan needs. (tp=1 and 1F1B are fixed: data and pipeline layouts, one schedule, keep the
    test short.)"""
    chosen = [ample.best]
    for share in (0.9, 0.5):
        budget = share * ample.best.peak_bytes
        best = fxpar.plan_auto(captured, world_size=2, hardware="h100", memory_per_device=budget,
                                   fixed="tp=1 schedule=1f1b").best
        assert best.peak_bytes <= budget and best.seconds >= chosen[-1].seconds
        chosen.append(best)
    assert chosen[1].plan.zero in (1, 2) and chosen[1].plan.checkpoint == "none" and chosen[1].plan.pp == 1
    assert chosen[2].plan.checkpoint != "none" or chosen[2].plan.pp > 1 or chosen[2].plan.zero == 3
    with pytest.raises(fxpar.PlanError, match="the least a plan needs is") as caught:
        fxpar.plan_auto(captured, world_size=2, hardware="h100", memory_per_device=0.3 * ample.best.peak_bytes,
                        fixed="tp=1 schedule=1f1b")
    assert caught.value.field == "memory_per_device"


def test_compile_auto_compiles_the_choice_for_the_launchs_world(captured, ample, monkeypatch):
    program = fxpar.compile(captured, "auto", world_size=2, hardware="h100", memory_per_device=AMPLE)
    assert program.plan == ample.plan and program.world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    assert fxpar.compile(captured, "auto", hardware="h100", memory_per_device=AMPLE).plan == ample.plan
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(fxpar.PlanError, match="neither world_size nor torchrun's WORLD_SIZE") as caught:
        fxpar.compile(captured, "auto", hardware="h100")
    assert caught.value.field == "world_size"


def test_plan_parse_auto_says_how_to_search():
    with pytest.raises(fxpar.PlanError, match=r"fxpar.compile\(model, 'auto', inputs, world_size=N\)"):
        Plan.parse("auto")


def test_fixed_fields_hold_in_every_ranked_plan(captured):
    search = fxpar.plan_auto(captured, world_size=2, hardware="h100", memory_per_device=AMPLE,
                             fixed="zero=1, mb=2")
    assert search.ranked and all(s.plan.zero == 1 and s.plan.microbatches == 2 for s in search.ranked)
    assert search.plan.dp == 2  # ZeRO shards over dp: only dp=2 can hold zero=1


def test_compiled_mode_is_searched_when_fixed_and_priced_by_its_kernels(captured):
    """`fixed="compile=inductor"` searches compiled plans, priced by the kernels Inductor runs
    (`cost.fused_kernels`): on the h100 profile fewer launches and bytes than eager mode's
    ops, so the same layout is predicted faster compiled."""
    fixed = "dp=2, zero=0, compile=inductor, checkpoint=none"
    search = fxpar.plan_auto(captured, world_size=2, hardware="h100", memory_per_device=AMPLE, fixed=fixed)
    assert search.plan == Plan(dp=2, compile="inductor")
    assert search.best.seconds < estimate(captured, Plan(dp=2)).time["total"]
