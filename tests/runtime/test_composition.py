"""Tier 3: every axis at once. dp=2 x tp=2 x pp=2 on 8 ranks equals one device.

The issue's composition proof (#13): the three degrees together, with ZeRO-1 (Megatron's
distributed optimizer under a pipeline) and with ZeRO-3, on the Llama-style model (its head is
untied: ZeRO-3 refuses a parameter tied across pipeline ranks, whose gradient is whole only
after the step's end). Compared as every equivalence test is (loss of every step, every
gradient, all parameters and optimizer state after 5 AdamW steps, relative 1e-5: see
tests/runtime/test_data_parallel_equivalence.py), and every step's collectives are the step
program's. One launch of 8 ranks (about 12 s to come up on 2 cores).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_tensor_parallel_equivalence import train_and_compare  # noqa: E402

pytestmark = pytest.mark.multirank


def test_dp2_tp2_pp2_with_zero_matches_single_device(torchrun):
    train_and_compare(torchrun, 8, ["dp=2 tp=2 pp=2 mb=4 zero=1", "dp=2 tp=2 pp=2 mb=4 zero=3"], "llama")
