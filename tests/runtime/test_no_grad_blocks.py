"""Tier 3: a forward with a `torch.no_grad()` block trains as it does on one device.

`fxpar.frontend.grad_regions` inlines the block's ops on detached inputs. What one device does
with such a block, and what is held here for `tiny_training.NoGradRouter` (a router choosing
each token's expert under no_grad) over 5 AdamW steps, against one device: the loss of every
step, every gradient of the first and all parameters after the last, relative 1e-5 (the same
sums in another order, as in test_data_parallel_equivalence); the parameter read only inside
the block gets no gradient (none is reported, as one device's `.grad` stays None) and is
bit-identical to its initial value after the steps: no bucket waits for its gradient, and no
optimizer, sharded or not, steps it (AdamW's weight decay would move it).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank
PLANS = ("dp=2 zero=1", "dp=2 zero=3 mb=2", "pp=2 mb=2", "tp=2")
UNTRAINED = ("bias_of_choice.weight", "bias_of_choice.bias")


def relative(a: dict, b: dict) -> float:
    difference = torch.cat([(a[k] - b[k]).flatten() for k in b])
    return float(difference.norm() / torch.cat([v.flatten() for v in b.values()]).norm())


def test_a_router_choosing_under_no_grad_trains_as_one_device(torchrun):
    ranks = torchrun("train_worker.py", 2, *PLANS, env={"FXPAR_TEST_MODEL": "router"})
    reference, initial = train_single_device("router"), build_model("router").state_dict()
    assert not set(UNTRAINED) & set(reference["grads"])  # one device: no gradient either
    for results in ranks:
        for plan in PLANS:
            result = results[plan]
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                                       rtol=1e-5, atol=0, msg=plan)
            assert set(result["grads"]) == set(reference["grads"]), plan
            assert relative(result["grads"], reference["grads"]) < 1e-5, plan
            assert relative(result["state"], reference["state"]) < 1e-5, plan
            for name in UNTRAINED:
                assert torch.equal(result["state"][name], initial[name]), (plan, name)
