"""Tier 5: the CUDA path, run on a GPU machine (skipped without CUDA).

Tolerance: 1e-4 relative instead of the CPU tier's 1e-5, because the CUDA reference and the
CPU reference run different fp32 kernels (cuBLAS, the memory-efficient attention kernel), whose
summation orders differ by more ulps than the CPU's do between one and several ranks.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import STEPS, train_single_device  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]


def _close(result, reference, rel=1e-4):
    for loss, ref in zip(result["losses"], reference["losses"]):
        assert loss == pytest.approx(ref, rel=rel)
    state, ref_state = result["state"], reference["state"]
    difference = torch.cat([(state[k] - ref_state[k]).flatten() for k in ref_state])
    norm = torch.cat([v.flatten() for v in ref_state.values()])
    assert difference.norm() <= rel * norm.norm()


def test_world_size_one_on_nccl(torchrun):
    (result,) = torchrun("train_worker.py", 1, "dp=1", env={"FXPAR_TEST_DEVICE": "cuda"})
    assert len(result["dp=1"]["losses"]) == STEPS
    _close(result["dp=1"], train_single_device())


# Gloo with CUDA tensors: the plans' collectives (all-reduce; ZeRO's reduce-scatter and
# all-gather) on device memory, two ranks on one GPU (NCCL refuses two ranks on one device).
SHARED_GPU_PLANS = ("dp=2", "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3")


def test_two_gloo_ranks_share_one_gpu(torchrun):
    ranks = torchrun(
        "train_worker.py", 2, *SHARED_GPU_PLANS,
        env={"FXPAR_TEST_DEVICE": "cuda:0", "FXPAR_TEST_BACKEND": "gloo"},
    )
    reference = train_single_device()
    for results in ranks:
        for plan in SHARED_GPU_PLANS:
            _close(results[plan], reference)
