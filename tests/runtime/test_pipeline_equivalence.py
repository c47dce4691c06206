"""Tier 3: pipeline-parallel training under fxpar equals single-device training.

GPT and Llama-style models, pp = 2 and 4, 4 and 8 microbatches, every schedule (GPipe, 1F1B,
interleaved 1F1B), and pipelines combined with dp = 2 and with tp = 2. Tolerances and their
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
from test_tensor_parallel_equivalence import assert_collectives_as_predicted  # noqa: E402
from tiny_training import train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_pp2_every_schedule_matches_single_device(torchrun, model):
    plans = ["pp=2 mb=4", "pp=2 mb=8 schedule=gpipe", "pp=2 mb=4 schedule=interleaved virtual_stages=2"]
    ranks = torchrun("train_worker.py", 2, *plans, env={"FXPAR_TEST_MODEL": model})
    reference = train_single_device(model)
    for plan in plans:
        for results in ranks:
            assert_equivalent(results[plan], reference, tied=model != "llama", model=model)
            assert_collectives_as_predicted(results[plan])


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_pp4_and_pipelines_with_dp_and_tp_match_single_device(torchrun, model):
    plans = ["pp=4 mb=8", "pp=4 mb=4 schedule=gpipe", "dp=2 pp=2 mb=4", "pp=2 tp=2 mb=4"]
    ranks = torchrun("train_worker.py", 4, *plans, env={"FXPAR_TEST_MODEL": model})
    reference = train_single_device(model)
    for plan in plans:
        for results in ranks:
            assert_equivalent(results[plan], reference, tied=model != "llama", model=model)
            assert_collectives_as_predicted(results[plan])
