"""Tier 1: when ZeRO-2/3 reduce-scatter gradients with several microbatches, and who follows it.

`fxpar.plan.zero_reduction`: per microbatch (each backward's gradients reduce-scattered after it,
only the shards accumulate) or per step (the whole gradients accumulate, one reduce-scatter),
named by the plan's `zero_reduce` or chosen by the cost model. The step program lists the
reductions where they happen, so the check, the estimate's bytes and (tests/runtime/
test_zero_equivalence.py) the runtime follow it; the estimate's peak counts the whole
gradients only where they live all step; `fxpar explain` and the report state the choice.
"""

import html
import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.cost.hardware import NOMINAL_CPU
from fxpar.errors import PlanError
from fxpar.ir.step_program import Communicate, Compute, Exchange, Purpose
from fxpar.tools.explain import explain
from fxpar.tools.report import write_report

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402

TOKENS, LABELS = global_batches()[0]


@pytest.fixture(scope="module")
def captured():
    return fxpar.capture(build_model(), (TOKENS, LABELS))


def _reduce_scatters(program, rank: int = 0) -> list:
    return [c for c in program.collectives(rank) if c.kind == "reduce_scatter"]


def test_zero_reduce_applies_to_zero_2_and_3_only_and_lists_its_values():
    with pytest.raises(PlanError, match="zero_reduce=step .* zero=1: ZeRO-1 keeps every gradient whole") as error:
        fxpar.Plan.parse("dp=2 zero=1 zero_reduce=step")
    assert error.value.field == "zero_reduce"
    with pytest.raises(PlanError, match="'auto', 'microbatch', 'step'"):
        fxpar.Plan.parse("dp=2 zero=2 zero_reduce=layer")
    assert str(fxpar.Plan.parse("dp=2 zero=3 mb=2 zero_reduce=step")) == "dp=2 mb=2 zero=3 zero_reduce=step"
    # zb-h1 runs B1 before W0 on its last stage: no point holds one microbatch's gradients.
    with pytest.raises(PlanError, match="later microbatch's B .* Fix: zero_reduce=step, or schedule=1f1b"):
        fxpar.Plan.parse("dp=2 pp=2 mb=4 zero=2 schedule=zb-h1 zero_reduce=microbatch")


def test_zero2_per_microbatch_reduces_every_microbatchs_buckets_after_its_backward(captured):
    each = fxpar.compile(captured, "dp=2 zero=2 mb=4 bucket_mb=0.02 zero_reduce=microbatch")
    once = fxpar.compile(captured, "dp=2 zero=2 mb=4 bucket_mb=0.02 zero_reduce=step")
    buckets = len(each.buckets)
    assert len(_reduce_scatters(each)) == 4 * buckets and len(_reduce_scatters(once)) == buckets
    kinds = [a.kind if isinstance(a, Compute) else "R" for a in each.step_program(0).actions
             if isinstance(a, Compute) or (isinstance(a, Communicate) and a.purpose is Purpose.GRADIENT_BUCKET)]
    assert kinds == ["F", "B", *"R" * buckets] * 4
    # The estimate reads the same list: 4x the bytes, and a peak without the whole gradients
    # beside the later microbatches' activations (4P bytes of fp32 gradients, less what the
    # max of the per-microbatch peak takes back).
    e_each, e_once = each.estimate("cpu"), once.estimate("cpu")
    assert e_each.comm["reduce_scatter"]["payload_bytes"] == 4 * e_once.comm["reduce_scatter"]["payload_bytes"]
    assert e_each.memory["total"] < e_once.memory["total"]
    assert e_each.memory["grads"] == e_once.memory["grads"]  # the shards, in both


def test_zero3_per_step_reduce_scatters_each_layer_once_in_the_last_backward(captured):
    each = fxpar.compile(captured, "dp=2 zero=3 mb=2 zero_reduce=microbatch")
    once = fxpar.compile(captured, "dp=2 zero=3 mb=2 zero_reduce=step")
    layers = len(_reduce_scatters(once))
    assert layers > 1 and len(_reduce_scatters(each)) == 2 * layers
    backwards = [a for a in once.step_program(0).actions if isinstance(a, Compute) and a.kind == "B"]
    assert [sum(c.kind == "reduce_scatter" for c in b.calls) for b in backwards] == [0, layers]
    # Per step, each layer's whole fp32 gradients are summed all step: 4P more at the peak,
    # less the one layer's that a reduce-scatter per microbatch lays out whole while in flight
    # (`cost.workspace.gathered_bytes`).
    parameters = captured.parameter_count()
    largest = max(4 * sum(v.numel() for v in node.meta["val"]) for module in each.stage_modules(0)
                  for node in module.graph.nodes if node.target is torch.ops.fxpar.gather_parameters.default)
    grown = once.estimate("cpu").memory["total"] - each.estimate("cpu").memory["total"]
    assert grown == pytest.approx(4 * parameters - largest, rel=0.02)


def test_auto_takes_per_step_where_nothing_hides_and_per_microbatch_where_it_does(captured, tmp_path):
    """On the CPU gloo hides nothing under compute (`comm_overlap` 0): the extra reductions
    cost their whole time, so per step. On an H100 NCCL overlaps them with the backwards of
    this small model: equally fast, and per microbatch holds less."""
    for plan in ("dp=2 zero=2 mb=2", "dp=2 zero=3 mb=2", "dp=2 pp=2 zero=2 mb=4"):
        cpu = fxpar.compile(captured, plan, hardware="cpu").zero_reduce
        gpu = fxpar.compile(captured, plan, hardware="h100").zero_reduce
        assert cpu.mode == "step" and cpu.seconds["step"] < cpu.seconds["microbatch"], plan
        assert gpu.mode == "microbatch", plan
        assert "exposed communication on cpu" in str(cpu) and "on h100" in str(gpu)
        # What is priced is the estimate's exposed communication, read off the same step programs.
        twin = fxpar.compile(captured, f"{plan} zero_reduce=step", hardware="cpu")
        assert twin.estimate(NOMINAL_CPU).time["comm_exposed"] == pytest.approx(cpu.seconds["step"])
    assert fxpar.compile(captured, "dp=2 zero=2").zero_reduce.reason == "one microbatch: reduced once either way"
    program = fxpar.compile(captured, "dp=2 zero=2 mb=2", hardware="cpu")
    assert f"ZeRO-2 {program.zero_reduce}" in explain(program, hardware="h100")
    page = write_report(program, tmp_path / "plan.html").read_text()
    assert f"<td>ZeRO reductions</td><td>{html.escape(str(program.zero_reduce))}</td>" in page


def test_a_pipeline_reduces_a_microbatchs_buckets_after_sending_its_gradients_on(captured):
    program = fxpar.compile(captured, "dp=2 pp=2 zero=2 mb=4 zero_reduce=microbatch")
    actions = program.step_program(program.world_size - 1).actions  # the last stage's row
    for i, action in enumerate(actions):
        if isinstance(action, Communicate) and action.purpose is Purpose.GRADIENT_BUCKET and i + 1 < len(actions):
            before = actions[i - 1]
            assert isinstance(before, Exchange) or isinstance(before, Communicate), before
    reductions = [a for a in actions if isinstance(a, Communicate) and a.purpose is Purpose.GRADIENT_BUCKET]
    held = [b for b in program.stages[1].buckets if b.held]  # the tied head waits for its sum
    assert len(reductions) == 4 * (len(program.stages[1].buckets) - len(held)) + len(held)


@pytest.mark.parametrize("plan", ["dp=2 zero=2 mb=2", "dp=2 zero=3 mb=2", "pp=2 dp=2 zero=2 mb=2"])
def test_the_modes_auto_prices_are_the_step_programs_each_plan_runs(captured, plan):
    """`zero_reduce=auto` prices each mode on the step programs lowering writes for it, the
    program's own lowering asked for that mode (no priced copy of the program): each equals
    the step program of the plan naming that mode, rank by rank."""
    def same(a, b) -> bool:  # StepProgram compares by identity (eq=False): compare what it holds
        return (a.actions, a.optimizer, a.stage_ranks, a.tied_groups) == (b.actions, b.optimizer, b.stage_ranks, b.tied_groups)

    auto = fxpar.compile(captured, f"{plan} zero_reduce=auto")
    for mode, per_microbatch in (("microbatch", True), ("step", False)):
        named = fxpar.compile(captured, f"{plan} zero_reduce={mode}")
        for rank in range(auto.world_size):
            assert same(auto._lowered(rank, per_microbatch=per_microbatch), named.step_program(rank))
    assert not same(auto._lowered(0, per_microbatch=True), auto._lowered(0, per_microbatch=False))
    chosen = auto.zero_reduce.per_microbatch
    assert all(same(auto.step_program(r), auto._lowered(r, per_microbatch=chosen)) for r in range(auto.world_size))
