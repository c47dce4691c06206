"""Tier 3: a learning-rate scheduler drives every optimizer `runner.optimizer` hands out.

torch's schedulers accept only a `torch.optim.Optimizer` and set the `lr` of its groups. Under
ZeRO-1/2 (`ShardedOptimizer`) and bf16-mixed (`MixedPrecisionOptimizer`) the optimizer the
user holds steps another over fxpar's own tensors (`runtime.state.wrapped_optimizer`); the groups a
scheduler writes must be the ones that optimizer reads. One launch trains the example Llama for 5
AdamW steps under `tiny_training.lr_scheduler` (StepLR, the rate halved each step) with each
kind of optimizer, and compares with one device trained under the same schedule:

* fp32 plans (ZeRO-1, ZeRO-2 with microbatches, ZeRO-3, whose optimizer is torch's own over
  the pieces): loss of each step and all parameters after the last, relative 1e-5 (sums of
  the same terms in another order, as in test_data_parallel_equivalence), and the full
  optimizer state's learning rate, the schedule's last;
* bf16-mixed, with and without ZeRO-1: bf16's stated tolerances against the same fp32
  training (test_mixed_precision_equivalence: losses relative 5e-3, the parameters within 0.2
  of the update fp32 training made), and the learning rate as above.

The schedule matters at these tolerances: the update of unscheduled training is 2.5 times
as long (5 steps at the first rate, against 1 + 1/2 + ... + 1/16 of them), and its final
parameters are further from the scheduled ones than any bound here allows (asserted).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import LR_DECAY, OPTIMIZER, STEPS, build_model, train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank
FP32 = ("dp=2 zero=1", "dp=2 zero=2 mb=2", "dp=2 zero=3")
BF16 = ("dp=2 precision=bf16-mixed", "dp=2 zero=1 precision=bf16-mixed")
FP32_RELATIVE = 1e-5
BF16_LOSS_RELATIVE, BF16_UPDATE_RELATIVE = 5e-3, 0.2


def distance(state: dict, reference: dict) -> float:
    """|state - reference| / |reference| over all tensors together."""
    difference = torch.cat([(state[k].float() - reference[k].float()).flatten() for k in reference])
    return float(difference.norm() / torch.cat([v.float().flatten() for v in reference.values()]).norm())


def test_a_scheduler_drives_the_sharded_and_mixed_precision_optimizers(torchrun):
    ranks = torchrun("train_worker.py", 2, *FP32, *BF16,
                     env={"FXPAR_TEST_SCHEDULED": "1", "FXPAR_TEST_MODEL": "llama"})
    scheduled, unscheduled = train_single_device("llama", scheduled=True), train_single_device("llama")
    initial = build_model("llama").state_dict()
    update = {k: scheduled["state"][k] - initial[k] for k in initial}

    def update_distance(state: dict) -> float:
        """How far `state` is from the scheduled fp32 training's, over the length of its update."""
        return distance({k: state[k] - initial[k] for k in initial}, update)

    assert update_distance(unscheduled["state"]) > 5 * BF16_UPDATE_RELATIVE
    last_lr = OPTIMIZER["lr"] * LR_DECAY**STEPS
    for results in ranks:
        for plan in (*FP32, *BF16):
            result = results[plan]
            (group,) = result["optimizer"]["param_groups"]
            assert group["lr"] == pytest.approx(last_lr, rel=1e-12), plan
            if plan in FP32:
                assert result["losses"] == pytest.approx(scheduled["losses"], rel=FP32_RELATIVE), plan
                assert distance(result["state"], scheduled["state"]) <= FP32_RELATIVE, plan
            else:
                assert result["losses"] == pytest.approx(scheduled["losses"], rel=BF16_LOSS_RELATIVE), plan
                assert update_distance(result["state"]) <= BF16_UPDATE_RELATIVE, plan


def test_a_loaded_checkpoint_gives_back_the_schedulers_initial_lr():
    """`runner.load(path, optimizer=...)` restores the saved groups' options as torch's
    `load_state_dict` does, keys the fresh optimizer lacks included: a scheduler made after the
    load to resume (`last_epoch=k`) reads `initial_lr`, which only the saved groups hold."""
    from fxpar.runtime.checkpoint.save_load import _restore_options

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    _restore_options(optimizer, [{"lr": 2.5e-3, "initial_lr": 1e-2, "betas": [0.8, 0.95]}])
    (group,) = optimizer.param_groups
    assert (group["lr"], group["initial_lr"], group["betas"]) == (2.5e-3, 1e-2, (0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=LR_DECAY, last_epoch=1)
    assert scheduler.base_lrs == [1e-2]
