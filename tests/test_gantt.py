"""The text Gantt chart of simulated and measured pipeline timelines."""

import pytest

from fxpar.schedule.gantt import gantt
from fxpar.schedule.schedules import schedule
from fxpar.schedule.simulation import simulate


def test_a_simulated_step_one_column_per_time_unit():
    run = simulate(schedule("1f1b", 2, 4), 1, 2)  # 15 time units: one column each
    assert gantt(run.timeline, width=15, unit="") == "\n".join([
        "rank 0 |FF..B0FB1FB2.B3|",
        "rank 1 |.FB0FB1FB2FB3..|",
        "        0          15.0",
    ])


def test_a_measured_timeline_in_seconds_with_text_actions():
    measured = [
        [("0F0", 10.000, 10.002), ("0B0", 10.006, 10.010)],
        [("1F0", 10.002, 10.004), ("1B0", 10.004, 10.006)],
    ]
    assert gantt(measured, width=10) == "\n".join([
        "rank 0 |F0....B000|",
        "rank 1 |..F0B0....|",
        "        0 ms 10.0 ms",
    ])


def test_zero_bubble_weight_actions_show_as_w():
    chart = gantt(simulate(schedule("zb-h1", 2, 4), 1, 1, weight_cost=1).timeline, width=13, unit="")
    assert chart.splitlines()[0].count("W") == 4 and "W" in chart.splitlines()[1]


def test_too_narrow_is_an_error():
    with pytest.raises(ValueError, match="at least 10 columns"):
        gantt([[("0F0", 0, 1)]], width=5)
