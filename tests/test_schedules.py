"""Pipeline schedules: the published bubble and memory figures, printed forms, checks, errors.

Costs are exact (ints and Fractions), so bubble fractions are compared with `==`: forward 1,
backward 2, no communication (docs/design.md, "Pipeline bubble"); ZB-H1 with F = B = W = 1 (Qi et
al. 2024, Sec. 3.1).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from fxpar.schedule.schedules import (
    Action,
    Schedule,
    check,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    schedule,
    zero_bubble_h1,
)
from fxpar.schedule.simulation import DeadlockError, simulate

FLAT = [(2, 4), (4, 4), (4, 8), (8, 16), (3, 5)]
INTERLEAVED = [(2, 2, 4), (4, 2, 8), (4, 4, 8), (2, 3, 2), (4, 2, 4)]
ZERO_BUBBLE = sorted({(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 16)})


def every_schedule() -> list[Schedule]:
    flat = [schedule(name, p, m) for name in ("gpipe", "1f1b", "zb-h1") for p, m in FLAT]
    return flat + [schedule("interleaved", p, m, v=v) for p, v, m in INTERLEAVED]


# -- bubble and activations against the papers -----------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", FLAT)
def test_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    simulation = simulate(schedule(name, p, m), 1, 2)
    assert simulation.bubble_fraction == Fraction(p - 1, m + p - 1)
    assert simulation.total == 3 * (m + p - 1)  # (m + p - 1)(t_f + t_b)
    assert simulation.busy == (3 * m,) * p


@pytest.mark.parametrize("p, v, m", INTERLEAVED)
@pytest.mark.parametrize("forward, backward", [(1, 2), (1, 1), (3, 1)])
def test_bubble_of_interleaved_shrinks_by_v(p, v, m, forward, backward):
    # A chunk holds 1/v of a rank's layers, so it costs 1/v of the rank's forward and backward.
    built = schedule("interleaved", p, m, v=v)
    simulation = simulate(built, Fraction(forward, v), Fraction(backward, v))
    assert simulation.bubble_fraction == Fraction(p - 1, v * m + p - 1)


def test_per_stage_costs_and_comm_cost():
    # The slowest stage sets the pace; comm adds a hop each way between ranks.
    uneven = simulate(one_f_one_b(2, 4), [1, 2], [2, 4])
    assert uneven.busy == (12, 24)
    # rank 1: 1F0 at 1.5, 1F1 at 2.5, 1B0 at 3.5, 1B1 at 5.5; rank 0's 0B1 waits to 7.5 + 0.5.
    assert simulate(gpipe(2, 2), 1, 2, comm_cost=Fraction(1, 2)).total == 8 + 2
    assert simulate(one_f_one_b(4, 8), 1.0, 2.0).bubble_fraction == pytest.approx(3 / 11, abs=1e-12)
    assert "~" in simulate(one_f_one_b(2, 3), 1, 2).grid()  # a backward spans two forward slots
    with pytest.raises(ValueError, match="3 entries for 2 stages"):
        simulate(gpipe(2, 2), [1, 1, 1], 2)


@pytest.mark.parametrize("p, m", FLAT)
def test_activations_in_flight(p, m):
    assert simulate(gpipe(p, m), 1, 2).peak_in_flight == (m,) * p
    peaks = simulate(one_f_one_b(p, m), 1, 2).peak_in_flight
    assert peaks[0] == min(p, m)
    assert peaks[p - 1] == 1
    assert peaks == tuple(p - r for r in range(p))


@pytest.mark.parametrize("built", [schedule("interleaved", 4, 8, v=2), zero_bubble_h1(4, 8)],
                         ids=lambda s: s.name)
def test_timeline_respects_order_and_dependencies(built):
    weight_cost = 1 if built.splits_backward else 0
    simulation = simulate(built, 1, 2, weight_cost=weight_cost, comm_cost=1)
    last = built.stages - 1
    ends = {a: end for row in simulation.timeline for a, _, end in row}
    for rank, row in enumerate(simulation.timeline):
        assert [a for a, _, _ in row] == list(simulation.schedule.actions[rank])
        for (_, _, end), (_, start, _) in zip(row, row[1:]):
            assert start >= end
        for a, start, _ in row:
            if a.kind == "F" and a.stage > 0:
                assert start >= ends[Action(a.stage - 1, "F", a.microbatch)] + 1
            if a.kind == "B" and a.stage < last:
                assert start >= ends[Action(a.stage + 1, "B", a.microbatch)] + 1
            if a.kind == "W":  # same rank as its B: no comm
                assert start >= ends[Action(a.stage, "B", a.microbatch)]


# -- zero bubble: the backward split into B and W ---------------------------------------------------


@pytest.mark.parametrize("p, m", ZERO_BUBBLE)
def test_bubble_of_zb_h1_is_p_minus_1_over_3m_plus_p_minus_1(p, m):
    """Qi et al. 2024, Sec. 3.1: with F = B = W = 1 each rank idles p - 1 slots of 3m + p - 1,
    and holds p microbatches from F until W on every rank, 1F1B's peak on rank 0."""
    simulation = simulate(zero_bubble_h1(p, m), 1, 1, weight_cost=1)
    assert simulation.bubble_fraction == Fraction(p - 1, 3 * m + p - 1)
    assert simulation.total == 3 * m + p - 1
    assert simulation.busy == (3 * m,) * p
    assert simulation.peak_in_flight == (p,) * p
    assert simulation.peak_in_flight[0] == simulate(one_f_one_b(p, m), 1, 2).peak_in_flight[0]


@pytest.mark.parametrize("forward, backward, weight", [(2, 2, 1), (1, 2, 1), (3, 2, 2), (4, 3, 1),
                                                       (2, 1, 2), (1, 3, 2), (1, 1, 0)])
@pytest.mark.parametrize("p, m", [(2, 2), (3, 5), (4, 8), (8, 16)])
def test_idle_time_of_zb_h1_against_1f1b(forward, backward, weight, p, m):
    """Per rank ZB-H1 idles (p-1)(F+B-W) where W <= F and W <= B (the paper's figure), in
    general (p-1) max(F+B-W, F, B); 1F1B running B and W as one backward idles (p-1)(F+B+W)."""
    zb = simulate(zero_bubble_h1(p, m), forward, backward, weight_cost=weight)
    assert zb.total - m * (forward + backward + weight) == (p - 1) * max(
        forward + backward - weight, forward, backward)
    if weight <= min(forward, backward):
        assert zb.total - zb.busy[0] == (p - 1) * (forward + backward - weight)
    whole = simulate(one_f_one_b(p, m), forward, backward + weight)
    assert whole.total - whole.busy[0] == (p - 1) * (forward + backward + weight)


def test_zb_h1_order_and_docstring_grid():
    built = zero_bubble_h1(2, 3)
    assert built.to_text().splitlines()[1:] == [
        "rank 0: 0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2",
        "rank 1: 1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2",
    ]
    assert built.splits_backward and not one_f_one_b(2, 3).splits_backward
    assert schedule("zb-h1", 2, 3) == built
    grid = "\n".join("        " + line for line in str(built).splitlines())
    assert grid in zero_bubble_h1.__doc__


def test_zb_h1_without_w_is_1f1b():
    """Rank r's row with its Ws removed is 1F1B's, B for B: the Ws only fill the drain."""
    for p, m in ZERO_BUBBLE:
        rows = [tuple(a for a in row if a.kind != "W") for row in zero_bubble_h1(p, m).actions]
        assert rows == list(one_f_one_b(p, m).actions)


def test_split_schedule_holds_activations_until_w():
    # p=1: in 1F1B's order each microbatch is freed by its B; with the Ws deferred, by its W.
    split = Schedule.from_text("rank 0: 0F0 0B0 0F1 0B1 0W0 0W1")
    assert simulate(split, 1, 1, weight_cost=1).peak_in_flight == (2,)
    assert simulate(Schedule.from_text("rank 0: 0F0 0B0 0F1 0B1"), 1, 1).peak_in_flight == (1,)


def test_weight_cost_needs_a_split_schedule():
    with pytest.raises(ValueError, match="runs no W actions.*add the weight gradient's time to backward_cost"):
        simulate(one_f_one_b(2, 4), 1, 1, weight_cost=1)
    assert simulate(one_f_one_b(2, 4), 1, 2, weight_cost=[0, 0]).total == 15  # zero is fine
    with pytest.raises(ValueError, match="weight_cost has 3 entries for 2 stages"):
        simulate(zero_bubble_h1(2, 4), 1, 1, weight_cost=[1, 1, 1])
    # one per stage, as forward_cost and backward_cost
    uneven = simulate(zero_bubble_h1(2, 4), 1, 1, weight_cost=[1, 2])
    assert uneven.busy == (12, 16)


# -- construction ----------------------------------------------------------------------------------


@pytest.mark.parametrize("built", every_schedule(), ids=lambda s: f"{s.name}-p{s.p}v{s.v}m{s.m}")
def test_check_passes_for_every_generated_schedule(built):
    check(built)


def test_one_f_one_b_order():
    assert one_f_one_b(2, 3).to_text().splitlines()[1:] == [
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2",
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2",
    ]
    assert gpipe(2, 2).actions[1] == tuple(map(Action.parse, "1F0 1F1 1B0 1B1".split()))


def test_interleaved_follows_megatron_order():
    # p=2, v=2: stages 0 and 2 on rank 0; forwards go in groups of p per chunk.
    rank0 = interleaved_one_f_one_b(2, 2, 4).actions[0]
    warmup = (2 - 0 - 1) * 2 + (2 - 1) * 2
    assert [str(a) for a in rank0[:warmup]] == ["0F0", "0F1", "2F0", "2F1"]
    assert [str(a) for a in rank0[warmup:warmup + 4]] == ["0F2", "2B0", "0F3", "2B1"]
    assert {a.stage for a in rank0} == {0, 2}


# -- printed forms ---------------------------------------------------------------------------------


def test_action_string_form_round_trips():
    assert str(Action(1, "F", 0)) == "1F0"
    assert Action.parse("1F0") == Action(1, "F", 0)
    assert Action.parse("12B34") == Action(12, "B", 34)
    assert Action.parse("0W3") == Action(0, "W", 3) and str(Action(0, "W", 3)) == "0W3"
    for bad in ["1X0", "F0", "1F", "", "0w3"]:
        with pytest.raises(ValueError, match=r"expected <stage><F\|B\|W><microbatch>"):
            Action.parse(bad)


@pytest.mark.parametrize("built", every_schedule(), ids=lambda s: f"{s.name}-p{s.p}v{s.v}m{s.m}")
def test_text_round_trip_and_grid_holds_each_action_once(built):
    assert Schedule.from_text(built.to_text()) == built
    cells = str(built).split()
    for row in built.actions:
        for a in row:
            assert cells.count(str(a)) == 1


def test_grid_of_1f1b():
    assert str(one_f_one_b(2, 3)).splitlines() == [
        "       t0  t1  t2  t3  t4  t5  t6  t7",
        "rank 0 0F0 0F1 .   0B0 0F2 0B1 .   0B2",
        "rank 1 .   1F0 1B0 1F1 1B1 1F2 1B2 .",
    ]


def test_module_docstring_grid_is_current():
    import fxpar.schedule.schedules

    grid = "\n".join("    " + line for line in str(schedule("1f1b", 2, 3)).splitlines())
    assert grid in fxpar.schedule.schedules.__doc__


def test_from_text_without_header_infers_sizes():
    built = Schedule.from_text("rank 0: 0F0 0B0\nrank 1: 1F0 1B0")
    assert (built.name, built.p, built.v, built.m) == ("custom", 2, 1, 1)
    with pytest.raises(ValueError, match="expected 'rank <r>: 0F0 0B0 ...'"):
        Schedule.from_text("0F0 0B0")


# -- checks and errors -----------------------------------------------------------------------------


def test_deadlock_names_blocked_action_and_marks_grid():
    bad = Schedule.from_text("rank 0: 0F0 0B0\nrank 1: 1B0 1F0")
    with pytest.raises(DeadlockError) as caught:
        simulate(bad, 1, 2)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert "rank 1 step 0: 1B0 waits for 1F0 (rank 1, step 1)" in message
    assert "rank 0 step 1: 0B0 waits for 1B0" in message
    assert "1B0!" in message and "0B0!" in message  # the grid marks where each rank stuck
    assert "1B0!" in str(bad)  # printing never raises


def test_deadlock_with_a_weight_gradient_names_its_backward():
    bad = Schedule.from_text("rank 0: 0F0 0W0 0B0")
    with pytest.raises(DeadlockError, match=r"rank 0 step 1: 0W0 waits for 0B0 \(rank 0, step 2\)"):
        simulate(bad, 1, 1, weight_cost=1)
    assert "0W0!" in str(bad)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("rank 0: 0F0 0B0\nrank 1: 1B0 1F0", "backward before its forward"),
        ("rank 0: 0F0 0B0 1F0\nrank 1: 1B0", "stage 1 lives on rank 1"),
        ("rank 0: 0F0 0F0 0B0\nrank 1: 1F0 1B0", "already runs at step 0"),
        ("rank 0: 0F0 0B0\nrank 1: 1F0", "missing actions 1B0"),
        ("rank 0: 0F0 0W0 0B0\nrank 1: 1F0 1B0 1W0", "weight gradient before its backward"),
        ("rank 0: 0F0 0B0 0W0\nrank 1: 1F0 1B0", "missing actions 1W0"),
        ("rank 0: 0F0 0B0 0W0 1W0\nrank 1: 1F0 1B0", "stage 1 lives on rank 1"),
        ("rank 0: 0F0 0B0 0W0 0W0\nrank 1: 1F0 1B0 1W0", "already runs at step 2"),
    ],
)
def test_check_names_the_problem(text, problem):
    with pytest.raises(ValueError, match=problem):
        check(Schedule.from_text(text))


def test_errors_give_numbers_and_fix():
    with pytest.raises(ValueError, match=r"m=2 < p=4; use m >= 4 or the 'gpipe' schedule"):
        schedule("1f1b", 4, 2)
    with pytest.raises(ValueError, match=r"m=6, p=4, m % p = 2; use m=8 or m=4"):
        schedule("interleaved", 4, 6, v=2)
    with pytest.raises(ValueError, match="valid names are 1f1b, gpipe, interleaved, zb-h1"):
        schedule("zero-bubble", 4, 8)
    with pytest.raises(ValueError, match=r"zb-h1 needs .* m=2 < p=4; use m >= 4 or the 'gpipe'"):
        schedule("zb-h1", 4, 2)
    with pytest.raises(ValueError, match="zb-h1 runs one stage per rank, got v=2; use v=1"):
        schedule("zb-h1", 4, 8, v=2)
    with pytest.raises(ValueError, match="p=0"):
        zero_bubble_h1(0, 2)
    with pytest.raises(ValueError, match="v=2; use v=1 or 'interleaved'"):
        schedule("1f1b", 4, 8, v=2)
    with pytest.raises(ValueError, match="v >= 2"):
        schedule("interleaved", 4, 8)
    with pytest.raises(ValueError, match="m=0"):
        gpipe(2, 0)
