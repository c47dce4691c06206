"""Tier 1: the plans `plan="auto"` searches (`fxpar.planner.space`), and a device's memory as
written (`fxpar.planner.budget`)."""

import math

import pytest

import fxpar
from fxpar.planner.budget import memory_budget
from fxpar.planner.space import SearchSpace, divisors, memory_trade


def test_layouts_multiply_to_the_world_and_keep_tp_within_a_node():
    space = SearchSpace(world_size=32, devices_per_node=8, batch=64)
    layouts = space.layouts()
    assert all(dp * tp * pp * cp == 32 and cp == 1 for dp, tp, pp, cp in layouts)  # no sequence: no cp
    assert max(tp for _, tp, _, _ in layouts) == 8  # tp=16 and 32 would span nodes
    assert len(layouts) == len(set(layouts)) == 18  # 21 factorizations, 3 with tp > 8


def test_cp_splits_the_sequence_within_a_node_beside_tp():
    space = SearchSpace(world_size=8, devices_per_node=4, batch=8, sequence=12)
    layouts = space.layouts()
    assert {cp for *_, cp in layouts} == {1, 2, 4}  # 8 does not divide the 12 tokens
    assert all(tp * cp <= 4 for _, tp, _, cp in layouts)  # both on every layer's critical path
    assert (2, 2, 1, 2) in layouts and (1, 2, 1, 4) not in layouts
    assert all(not c["sequence_parallel"] for c in space.candidates() if c["cp"] > 1)


def test_ep_divides_both_dp_and_the_experts():
    space = SearchSpace(world_size=8, devices_per_node=8, batch=8, experts=4)
    candidates = list(space.candidates())
    assert {c["ep"] for c in candidates if c["dp"] == 8} == {1, 2, 4}  # 8 does not divide 4 experts
    assert {c["ep"] for c in candidates if c["dp"] == 2} == {1, 2}
    assert all(c["dp"] % c["ep"] == 0 for c in candidates)
    assert {c["zero"] for c in candidates if c["ep"] > 1} == {0, 1, 2, 3}
    assert {c["ep"] for c in SearchSpace(world_size=8, devices_per_node=8, batch=8).candidates()} == {1}


def test_every_candidate_splits_the_batch_and_keeps_the_fixed_fields():
    space = SearchSpace(world_size=4, devices_per_node=8, batch=8, fixed={"precision": "bf16-mixed"})
    candidates = list(space.candidates())
    assert candidates and all(c["precision"] == "bf16-mixed" for c in candidates)
    for c in candidates:
        assert 8 % (c["dp"] * c["microbatches"]) == 0, c
        assert c["zero"] == 0 or c["dp"] > 1, c  # nothing to shard over at dp=1
        assert not c["sequence_parallel"] or c["tp"] > 1, c
        assert (c.get("virtual_stages", 1) == 2) == (c["schedule"] == "interleaved"), c
        if c["pp"] > 1:
            assert c["microbatches"] % c["pp"] == 0, c
    schedules = {c["schedule"] for c in candidates if c["pp"] > 1}
    assert schedules == {"1f1b", "gpipe", "interleaved", "zb-h1"}


def test_a_fixed_degree_or_option_narrows_the_space():
    space = SearchSpace(world_size=8, devices_per_node=8, batch=16, fixed={"tp": 2, "checkpoint": "full"})
    candidates = list(space.candidates())
    assert {c["tp"] for c in candidates} == {2} and {c["checkpoint"] for c in candidates} == {"full"}
    assert {(c["dp"], c["pp"]) for c in candidates} == {(4, 1), (2, 2), (1, 4)}


def test_a_bad_fixed_field_is_the_plans_own_error():
    with pytest.raises(fxpar.PlanError, match="zero"):
        SearchSpace(world_size=2, devices_per_node=8, batch=8, fixed={"zero": 5})


def test_memory_trade_orders_recomputation_and_microbatches_only_without_a_pipeline():
    base = {"dp": 2, "tp": 1, "pp": 1, "zero": 0, "schedule": "1f1b", "sequence_parallel": False}
    plain = memory_trade({**base, "microbatches": 1, "checkpoint": "none"})
    heavier = memory_trade({**base, "microbatches": 2, "checkpoint": "full"})
    assert plain[0] == heavier[0] and all(map(int.__le__, plain[1], heavier[1]))
    piped = {**base, "dp": 1, "pp": 2}
    # With a pipeline microbatches shrink the bubble: they are part of what the time depends on.
    assert memory_trade({**piped, "microbatches": 2, "checkpoint": "none"})[0] != \
        memory_trade({**piped, "microbatches": 4, "checkpoint": "none"})[0]


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1]
    assert all(math.prod((d, 1024 // d)) == 1024 for d in divisors(1024))


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80e9), ("24 GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5e9", 1.5e9), (4096, 4096),
])
def test_memory_is_read_in_its_units(text, expected):
    assert memory_budget(text, world_size=1) == expected


@pytest.mark.parametrize("text", ["80 apples", "-3GB", "GB", ""])
def test_memory_that_is_not_an_amount_is_refused_naming_the_units(text):
    with pytest.raises(fxpar.PlanError, match="memory_per_device .* KiB, MiB, GiB"):
        memory_budget(text, world_size=1)


def test_without_a_budget_the_cpu_ranks_share_the_machines_memory():
    assert memory_budget(None, world_size=4) == pytest.approx(memory_budget(None, world_size=1) / 4)
