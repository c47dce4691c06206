"""Tier 3: pipeline-parallel training under fxpar equals single-device training.

GPT and Llama-style models, pp = 2 and 4, 4 and 8 microbatches, every schedule (GPipe, 1F1B,
interleaved 1F1B, zero-bubble ZB-H1 with its deferred weight gradients), and pipelines
combined with dp = 2 and with tp = 2. Tolerances and their
reasons are the data-parallel test's (relative 1e-5): microbatching sums the same gradients in
another order. Every step's transfers and collectives are compared with the compiler's
prediction and the cost model's payload, as in the tensor-parallel test.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel_equivalence import assert_equivalent  # noqa: E402
from test_tensor_parallel_equivalence import assert_collectives_as_predicted, train_and_compare  # noqa: E402
from tiny_training import train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank


def assert_ran_its_schedule(ranks: list[dict], plans: list[str]) -> None:
    """Each rank's executor ran its schedule row, action for action (W actions included)."""
    for plan in plans:
        for results in ranks:
            assert results[plan]["executed"] == results[plan]["schedule_row"], (plan, results[plan]["rank"])


@pytest.mark.parametrize("model", ["llama"])  # the GPT's: in NCCL's transfer order below, and at pp=4
def test_pp2_every_schedule_matches_single_device(torchrun, model):
    plans = ["pp=2 mb=4", "pp=2 mb=8 schedule=gpipe", "pp=2 mb=4 schedule=interleaved virtual_stages=2",
             "pp=2 mb=4 schedule=zb-h1"]
    assert_ran_its_schedule(train_and_compare(torchrun, 2, plans, model), plans)


def test_pipelines_in_nccls_transfer_order_match_single_device(torchrun):
    """Receives posted when their action comes (NCCL's order, `receives_ahead`), on gloo."""
    plans = ["pp=2 mb=4", "pp=2 mb=4 schedule=zb-h1", "pp=2 mb=4 schedule=interleaved virtual_stages=2"]
    ranks = torchrun("train_worker.py", 2, *plans, env={"FXPAR_TEST_RECEIVES_AHEAD": "0"})
    reference = train_single_device("gpt")
    for plan in plans:
        for results in ranks:
            assert_equivalent(results[plan], reference, tied=True, model="gpt")
            assert_collectives_as_predicted(results[plan])
    assert_ran_its_schedule(ranks, plans)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_pp4_and_pipelines_with_dp_and_tp_match_single_device(torchrun, model):
    plans = ["pp=4 mb=8", "pp=4 mb=4 schedule=gpipe", "dp=2 pp=2 mb=4", "pp=2 tp=2 mb=4",
             "pp=4 mb=8 schedule=zb-h1", "dp=2 pp=2 mb=4 schedule=zb-h1", "pp=2 tp=2 mb=4 schedule=zb-h1"]
    assert_ran_its_schedule(train_and_compare(torchrun, 4, plans, model), plans)
