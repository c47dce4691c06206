"""Tier 3: tensor-parallel training under fxpar equals single-device training.

Three model families (tiny_training.MODELS): a GPT with separate q/k/v, a GPT-2-style model
with a fused c_attn, and a Llama-style model (RMSNorm, rotary, grouped-query attention, SwiGLU,
untied head), under tp = 2 and 4, with sequence parallelism, and combined with dp = 2.
Tolerances and their reasons are those of the data-parallel test (relative 1e-5): sharding
sums the same products in another order.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel_equivalence import assert_equivalent  # noqa: E402
from tiny_training import train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("model", ["gpt", "gpt2", "llama"])
def test_tp2_matches_single_device(torchrun, model):
    plans = ("tp=2", "tp=2 sp=true")
    ranks = torchrun("train_worker.py", 2, *plans, env={"FXPAR_TEST_MODEL": model})
    reference = train_single_device(model)
    for plan in plans:
        for results in ranks:
            assert_equivalent(results[plan], reference, tied=model != "llama")
