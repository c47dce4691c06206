"""Tier 2: per-rank estimates under tensor and pipeline parallelism."""

import sys
from pathlib import Path

import pytest

import sympy

import fxpar
from fxpar.cost.layout import shares
from fxpar.schedule.simulation import simulate

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402

TOKENS, LABELS = global_batches()[0]


def held_parameter_bytes(program: fxpar.Program, rank: int) -> int:
    tensors = {n: p for m in program.stage_modules(rank) for n, p in m.named_parameters()}
    return 4 * sum(p.numel() for p in tensors.values())


@pytest.mark.parametrize("plan", ["tp=2", "pp=2 mb=4", "pp=2 tp=2 mb=2", "dp=2 tp=2"])
def test_parameter_memory_is_what_the_reported_rank_holds(plan):
    program = fxpar.compile(build_model("gpt"), plan, (TOKENS, LABELS))
    estimate = program.estimate("h100")
    assert estimate.memory["params"] == held_parameter_bytes(program, estimate.rank)
    assert estimate.memory["params"] < 4 * program.captured.parameter_count()


def test_tensor_parallel_ranks_do_half_the_matmul_work():
    whole = fxpar.compile(build_model("gpt"), "dp=1", (TOKENS, LABELS))
    split = fxpar.compile(build_model("gpt"), fxpar.Plan(tp=2, tp_rules={
        "h.*.attn.[qkv]": "colwise", "h.*.attn.o": "rowwise", "h.*.mlp.up": "colwise",
        "h.*.mlp.down": "rowwise", "wte": "vocab"}), (TOKENS, LABELS))
    assert split.estimate("h100").flops == whole.estimate("h100").flops  # the step's FLOPs
    (mine,), (all_of_it,) = shares(split), shares(whole)
    assert sympy.simplify(2 * mine.matmul_flops - all_of_it.matmul_flops) == 0


def test_pipeline_bubble_is_the_simulated_idle_time_of_the_rank():
    program = fxpar.compile(build_model("gpt"), "pp=2 mb=4", (TOKENS, LABELS))
    estimate = program.estimate("h100")
    assert estimate.time["bubble"] > 0
    assert estimate.time["total"] == pytest.approx(
        sum(estimate.time[k] for k in ("compute", "optimizer", "comm_exposed", "bubble"))
    )
    # Unit costs: the schedule's textbook bubble, which the estimate's simulation generalises.
    assert simulate(program.schedule, 1, 2).bubble_fraction == pytest.approx(1 / 5)


def test_gpipe_holds_more_activations_than_1f1b():
    gpipe = fxpar.compile(build_model("gpt"), "pp=2 mb=8 schedule=gpipe", (TOKENS, LABELS)).estimate("h100")
    one_f_one_b = fxpar.compile(build_model("gpt"), "pp=2 mb=8", (TOKENS, LABELS)).estimate("h100")
    assert gpipe.memory["activations"] > 2 * one_f_one_b.memory["activations"]
