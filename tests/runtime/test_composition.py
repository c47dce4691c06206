"""Tier 3: every axis at once. dp=2 x tp=2 x pp=2 on 8 ranks equals one device.

The issue's composition proof (#13): the three degrees together, with ZeRO-1 (Megatron's
distributed optimizer under a pipeline), with ZeRO-3, and with ZeRO-3 under bf16-mixed, on
the Llama-style model. The fp32 plans are compared as every equivalence test is (loss of every
step, every gradient, all parameters and optimizer state after 5 AdamW steps, relative 1e-5:
see tests/runtime/test_data_parallel_equivalence.py); the bf16 plan within bf16's stated
tolerances against one device's fp32 training (tests/runtime/test_mixed_precision_equivalence.py),
with bf16 weights, fp32 masters and an fp32 loss on every rank. Every step's collectives are
the step program's. One launch of 8 ranks (about 12 s to come up on 2 cores).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel_equivalence import assert_equivalent  # noqa: E402
from test_mixed_precision_equivalence import (  # noqa: E402
    LLAMA, _fp32_reference, assert_mixed_precision_rank, assert_within_bf16,
)
from test_tensor_parallel_equivalence import assert_collectives_as_predicted  # noqa: E402
from tiny_training import train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank

FP32 = ["dp=2 tp=2 pp=2 mb=4 zero=1", "dp=2 tp=2 pp=2 mb=4 zero=3"]
BF16 = "dp=2 tp=2 pp=2 mb=4 zero=3 precision=bf16-mixed reduce_dtype=bf16"


def test_dp2_tp2_pp2_with_zero_and_bf16_matches_single_device(torchrun):
    ranks = torchrun("train_worker.py", 8, *FP32, BF16, env=LLAMA)
    reference = train_single_device("llama")
    for plan in FP32:
        for result in ranks:
            assert_equivalent(result[plan], reference, tied=False, model="llama")
            assert_collectives_as_predicted(result[plan])
    bf16_reference = _fp32_reference("llama")
    for result in ranks:
        assert_within_bf16(result[BF16], bf16_reference)
    assert_mixed_precision_rank(ranks, BF16)  # dtypes, collectives and bytes on every rank
