"""Tier 3: `runner.clip_grad_norm_` is `torch.nn.utils.clip_grad_norm_` on one device, for every plan.

The global norm runs over every gradient element once, however the ranks hold them
(`runtime.state.gradient_norm`): in pieces (tp shards, ZeRO-1/2's bucket shards, ZeRO-3's flat
pieces, pipeline stages) and in copies (replicated over dp or tp, the tiny GPT's embedding tied
to its head across two pipeline stages). One four-rank launch trains the tiny GPT for 5 AdamW
steps, clipping to a 2-norm of 0.4 before each (the one-device norms run 0.56-1.13, so every
step clips), under plans that cover each way of holding a gradient; against one device doing the
same: the norm of each step and the loss of each step, relative 1e-5, and all parameters
after the last, relative 1e-5 (sums of the same terms in another order, as in
test_data_parallel_equivalence).

Each step also asks for the inf-norm first (a bound of inf scales nothing), the maximum over
the ranks' pieces. A norm counted twice or not at all would be off by far more: the copies of
a replicated gradient and the tp-replicated layer norms are a few percent of the squared norm
or more (the test fails with either left uncounted as a copy).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank
MAX_NORM = 0.4
RELATIVE = 1e-5
PLANS = ("dp=4", "dp=2 tp=2", "tp=2 pp=2 mb=2", "dp=2 pp=2 mb=2 zero=1", "dp=2 tp=2 zero=2",
         "dp=4 zero=3", "dp=2 tp=2 zero=3 mb=2",
         "dp=2 cp=2", "dp=2 cp=2 zero=2")  # a cp rank's gradients are copies of its peer's: counted once


def test_clipping_by_the_global_norm_matches_single_device(torchrun):
    ranks = torchrun("train_worker.py", 4, *PLANS, env={"FXPAR_TEST_CLIP": str(MAX_NORM)})
    reference = train_single_device(clip=MAX_NORM)
    assert min(norm for _, norm in reference["norms"]) > MAX_NORM  # every step clips
    for results in ranks:
        for plan in PLANS:
            result = results[plan]
            for kind in (0, 1):  # the inf-norm, the 2-norm
                norms = [n[kind] for n in result["norms"]]
                assert norms == pytest.approx([n[kind] for n in reference["norms"]], rel=RELATIVE), plan
            assert result["losses"] == pytest.approx(reference["losses"], rel=RELATIVE), plan
            state, expected = result["state"], reference["state"]
            difference = torch.cat([(state[k] - expected[k]).flatten() for k in expected])
            assert difference.norm() <= RELATIVE * torch.cat([v.flatten() for v in expected.values()]).norm(), plan
