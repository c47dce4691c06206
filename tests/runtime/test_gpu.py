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


def test_two_gloo_ranks_share_one_gpu(torchrun):
    ranks = torchrun(
        "train_worker.py", 2, "dp=2",
        env={"FXPAR_TEST_DEVICE": "cuda:0", "FXPAR_TEST_BACKEND": "gloo"},
    )
    reference = train_single_device()
    for results in ranks:
        _close(results["dp=2"], reference)
