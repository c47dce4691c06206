"""`fxpar.diff`: what changes between two plans of one model, checked against each program's
own collectives and estimate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fxpar

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import factory  # noqa: E402
from small_gpt import small_capture  # noqa: E402



@pytest.fixture(scope="module")
def programs():
    captured = small_capture()
    return fxpar.compile(captured, "dp=4"), fxpar.compile(captured, "dp=2 tp=2 pp=2 mb=2")


def test_collectives_added_and_removed_per_step_with_their_bytes(programs):
    before, after = programs
    change = fxpar.diff(before, after)
    rows = {(r.section, r.item): r for r in change.rows}
    tp = rows[("rank 0 per step", "all_reduce tp all_reduce")]
    calls = [c for c in after.collectives(0) if c.tag == "tp all_reduce"]
    assert (tp.mark, tp.before, tp.after) == ("+", None, (len(calls), sum(c.payload_bytes for c in calls)))
    assert rows[("rank 0 per step", "all_reduce dp gradient bucket # + loss + valid targets + step")].mark == "-"
    assert rows[("rank 0 per step", "send pp stage # activations")].after[0] == 2  # one per microbatch
    moved = rows[("bytes", "payload of rank 0's collectives per step")]
    assert moved.before == sum(c.payload_bytes for c in before.collectives(0))
    assert moved.after == sum(c.payload_bytes for c in after.collectives(0))


def test_memory_per_pipeline_rank_and_time_come_from_the_estimates(programs):
    before, after = programs
    change = fxpar.diff(before, after, hardware="a100")
    rows = {(r.section, r.item): r for r in change.rows}
    assert rows[("memory", "peak of pipeline rank 1")].before is None  # dp=4 has no pipeline
    assert rows[("time", "total on a100")].after == after.estimate("a100").time["total"]
    assert rows[("memory", "params of the reported rank")].before == before.estimate("a100").memory["params"]


def test_text_and_table_say_the_same(programs):
    change = fxpar.diff(*programs)
    text = str(change)
    parameters = programs[0].captured.parameter_count()
    assert text.startswith(f"plan diff: 'dp=4' -> 'dp=2 pp=2 tp=2 mb=2', 4 -> 8 ranks, {parameters:,} parameters")
    assert "+ rank 0 per step: all_reduce tp all_reduce" in text
    table = change.table()
    assert len(table) == len(change.rows) and all(len(row) == 5 for row in table)
    assert fxpar.diff(programs[0], programs[0]).table()[0][0] == " "  # a plan against itself


def test_plans_of_different_models_are_refused(programs):
    model, inputs = factory(n_layer=1, n_head=4, n_embd=32, vocab_size=64, seq=16, batch=8)
    other = fxpar.compile(model, "dp=2", example_inputs=inputs)
    with pytest.raises(ValueError, match="two plans of one model.*fxpar.capture"):
        fxpar.diff(programs[0], other)
    with pytest.raises(ValueError, match="rank 4"):
        fxpar.diff(*programs, rank=4)
