"""Tier 3: ZeRO-1, ZeRO-2 and ZeRO-3 training under fxpar equals single-device training.

Each rank keeps AdamW's state for its shard of every flat gradient bucket (ZeRO-1), and
under ZeRO-2 only its shard of the reduced gradients; the updated parameters are gathered
back after each step (`runtime.state.sharded_optimizer`). Compared with the single-device
reference as the data-parallel tests are (tests/runtime/test_data_parallel_equivalence.py:
loss of every step, every gradient of the first step, all parameters after 5 AdamW steps,
relative 1e-5 for the reasons given there), with dp alone and composed with microbatches,
tensor parallelism (with sequence parallelism: its partial-gradient parameters are reduced
after their tp sum, `Bucket.held`) and pipelines (the tied embedding and head, likewise).
Every step's collectives, the optimizer's gathers included, are the step program's. ZeRO-3
(`passes.zero3`): each rank stores a flat piece of every parameter, gathered per layer by the
graph, prefetched and gathered again for backward by default; the same compositions. With
microbatches both ways of reducing run (`zero_reduce`: per microbatch, named in the plan, and
per step, what auto picks on the CPU; `fxpar.plan.zero_reduction`), interleaved stages included.
"""

import sys
from pathlib import Path

import pytest

import fxpar
from fxpar.errors import PlanError


sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel_equivalence import assert_equivalent, reference  # noqa: E402,F401
from test_tensor_parallel_equivalence import assert_collectives_as_predicted  # noqa: E402
from tiny_training import build_model, global_batches  # noqa: E402

pytestmark = pytest.mark.multirank


def assert_model_state_as_predicted(result: dict, *, zero: int, dp: int) -> None:
    """Bytes held after a step (`runner.memory_stats()`) are ZeRO's (Sec. 5) for fp32 AdamW,
    16P, 8P + 8P/N, 4P + 12P/N, 16P/N, and the estimate's, to within what the layout adds:
    padding to a multiple of N (each bucket's under stages 1 and 2, each parameter's under
    stage 3; stated: under 1% here), AdamW's step counter per tensor it steps, and the loss's
    slot in DDP's last bucket."""
    buckets = result["buckets"]
    P = sum(b.numel for b in buckets)
    parameters = sum(len(b.parameters) for b in buckets)
    padding = {0: 0, 1: sum(b.padded(dp) - b.numel for b in buckets), 3: dp * parameters}.get(
        zero, sum(b.padded(dp) - b.numel for b in buckets))
    assert padding <= 0.01 * P * (dp if zero == 3 else 1)
    paper = {0: (4 * P, 4 * P, 8 * P), 1: (4 * P, 4 * P, 8 * P / dp), 2: (4 * P, 4 * P / dp, 8 * P / dp),
             3: (4 * P / dp, 4 * P / dp, 8 * P / dp)}[zero]
    counters = len(buckets) if zero in (1, 2) else parameters  # AdamW's `step`s
    slack = 8 * padding / (dp if zero == 3 else 1) + 4 * counters + 4  # padding, step counters, the loss slot
    measured = result["memory"]
    for key, expected in zip(("params", "grads", "optimizer"), paper):
        assert abs(measured[key] - expected) <= slack, (key, measured[key], expected)
        assert abs(measured[key] - result["estimated_memory"][key]) <= slack, key


def test_zero_on_two_ranks_matches_single_device(torchrun, reference):
    plans = ["dp=2 zero=1", "dp=2 zero=2 mb=2 bucket_mb=0.01", "dp=2 zero=2 mb=2 bucket_mb=0.01 zero_reduce=microbatch",
             "dp=2"]
    for results in torchrun("train_worker.py", 2, *plans):
        for plan in plans:
            assert_equivalent(results[plan], reference)
            assert_collectives_as_predicted(results[plan])
            zero = int(plan.split("zero=")[1][0]) if "zero=" in plan else 0
            assert_model_state_as_predicted(results[plan], zero=zero, dp=2)


def test_zero_composed_on_four_ranks_matches_single_device(torchrun, reference):
    plans = ["dp=4 zero=2 bucket_mb=0.05", "dp=2 tp=2 zero=1 mb=2", "dp=2 tp=2 sp=true zero=2",
             "dp=2 pp=2 zero=1 mb=4", "dp=2 pp=2 zero=2 mb=4 schedule=zb-h1", "dp=4 zero=3 prefetch=2",
             "dp=2 tp=2 zero=3 mb=2", "dp=2 tp=2 sp=true zero=3",
             "dp=2 pp=2 zero=3 mb=4 schedule=interleaved virtual_stages=2",
             "dp=2 pp=2 zero=2 mb=4 schedule=interleaved virtual_stages=2 zero_reduce=microbatch",
             "dp=2 pp=2 zero=3 mb=4 zero_reduce=microbatch",
             "dp=2 tp=2 sp=true zero=2 mb=2 zero_reduce=microbatch"]
    for results in torchrun("train_worker.py", 4, *plans):
        for plan in plans:
            assert_equivalent(results[plan], reference)
            assert_collectives_as_predicted(results[plan])


def test_zero3_on_two_ranks_matches_single_device(torchrun, reference):
    """ZeRO-3: each rank stores a flat piece of every parameter; each layer's are gathered in
    forward and their gradients reduce-scattered in backward by the graph's own ops."""
    plans = ["dp=2 zero=3", "dp=2 zero=3 mb=2 reshard_after_forward=false prefetch=0", "dp=2 zero=3 mb=2 zero_reduce=microbatch"]
    for results in torchrun("train_worker.py", 2, *plans):
        for plan in plans:
            assert_equivalent(results[plan], reference)
            assert_collectives_as_predicted(results[plan])
            assert_model_state_as_predicted(results[plan], zero=3, dp=2)


def test_zero3_refuses_weight_gradients_deferred_past_the_layer():
    """Zero bubble's W actions compute weight gradients after the layer's backward, where
    ZeRO-3 has already reduce-scattered them: a PlanError at compile, not a wrong step."""
    tokens, labels = global_batches()[0]
    with pytest.raises(PlanError, match="defers weight gradients .* Fix: schedule=1f1b") as error:
        fxpar.compile(build_model("gpt"), "dp=2 pp=2 zero=3 mb=4 schedule=zb-h1", example_inputs=(tokens, labels))
    assert error.value.field == "zero"
