"""Tier 3: `runner.step` twice without `zero_grad` accumulates as one device's two backwards.

One 2-rank launch (tests/workers/accumulation_worker.py) runs the worker's `SCRIPT` under every
plan: steps on batches 0 and 1 with no `zero_grad` between them, then `zero_grad(set_to_none=
False)` and a step on batch 1, `zero_grad()` and steps on batches 0 and 1 again, reading the
whole gradients (`runner.full_gradients`) after each step, then one SGD step. One device runs
the same script: `.grad` after the second backward is g0 + g1 (`runtime.step.gradient_accumulation`
says why a distributed step must set the earlier gradients aside to get it). Before the fix the
accumulated gradient of dp, ZeRO-1/2, tp with sp, pp and bf16-mixed was off by up to 70%
(the bucket's all-reduce summed the held g0 over the ranks and divided it by the second step's
count of valid targets; ZeRO overwrote or re-reduced its shard; the tp and tied-weight sums
added each copy's g0 again).

Tolerances. fp32 against one device: relative 1e-5 per gradient with an absolute floor of 1e-6
x the largest gradient norm, and for the parameters after the SGD step the norm of the
difference against the norm of one device's update (the update is lr x the accumulated
gradient): the reasons of tests/runtime/test_data_parallel_equivalence.py (the ranks sum the
same per-token gradients in another order; the attention key bias's true gradient is zero and
its computed one noise). bf16-mixed against one device's fp32: relative 2e-2 over all the
gradients together, and the same for the update, bf16's gradient tolerance and why in
tests/runtime/test_mixed_precision_equivalence.py. Against the plan's own steps the sum is
exact: the accumulated gradient is bitwise the plan's gradient of batch 0 plus its gradient of
batch 1 (read after the steps that follow `zero_grad`), rounded to the gradients' dtype (bf16
under bf16-mixed without ZeRO), and the second accumulation equals the first, so `zero_grad`
with either `set_to_none` leaves nothing behind.
"""

import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fxpar.ir.buckets import Bucket
from fxpar.ir.mesh import Axis
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.state.gradient_buckets import GradientBuckets
from fxpar.runtime.step.gradient_accumulation import EarlierGradients

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from accumulation_worker import SCRIPT, one_device  # noqa: E402

RELATIVE = 1e-5  # fp32 (module doc)
BF16_RELATIVE = 2e-2  # bf16-mixed against fp32 (module doc)
BF16_LOSS = 5e-3  # and its loss, bf16's 8-bit significand (test_mixed_precision_equivalence)
BF16 = "precision=bf16-mixed"
PLANS = [
    "dp=2", "dp=2 mb=2 bucket_mb=0.01", "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=2 mb=2 zero_reduce=microbatch",
    "dp=2 zero=3", "tp=2", "tp=2 sp=true", "pp=2 mb=2", f"dp=2 {BF16}",
]
ACCUMULATED, SECOND_ACCUMULATED = 1, 4  # positions in SCRIPT
ALONE = {0: 0, 1: 2}  # batch -> the position of a step of it alone, after no step or a zero_grad
assert [SCRIPT[i][0] for i in (ACCUMULATED, SECOND_ACCUMULATED)] == [1, 1] and SCRIPT[ALONE[1]][1] is not None


@pytest.fixture(scope="module")
def reference():
    return one_device()


@pytest.fixture(scope="module")
def ranks(module_torchrun):
    return module_torchrun("accumulation_worker.py", 2, *PLANS)


@pytest.mark.multirank
@pytest.mark.parametrize("plan", PLANS)
def test_accumulated_gradients_and_step_match_one_device(ranks, reference, plan):
    for rank in ranks:
        result = rank[plan]
        assert result["losses"] == pytest.approx(reference["losses"], rel=BF16_LOSS if BF16 in plan else RELATIVE)
        for position, (grads, expected) in enumerate(zip(result["grads"], reference["grads"])):
            assert_gradients_close(grads, expected, bf16=BF16 in plan, what=f"after step {position} of {SCRIPT}")
        state, expected, initial = result["state"], reference["state"], reference["initial"]
        difference = torch.cat([(state[k] - expected[k]).flatten() for k in expected])
        update = torch.cat([(expected[k] - initial[k]).flatten() for k in expected])
        assert difference.norm() <= (BF16_RELATIVE if BF16 in plan else RELATIVE) * update.norm()


@pytest.mark.multirank
@pytest.mark.parametrize("plan", PLANS)
def test_accumulated_gradient_is_the_plans_own_sum(ranks, plan):
    grads = ranks[0][plan]["grads"]
    dtype = torch.bfloat16 if BF16 in plan and "zero=" not in plan else torch.float32
    for name, accumulated in grads[ACCUMULATED].items():
        alone = (grads[ALONE[0]][name] + grads[ALONE[1]][name]).to(dtype).float()
        assert torch.equal(accumulated, alone), name
        assert torch.equal(grads[SECOND_ACCUMULATED][name], accumulated), name


def assert_gradients_close(grads: dict, expected: dict, *, bf16: bool, what: str) -> None:
    """Per parameter within `RELATIVE` (and the floor), or under bf16 all together within
    `BF16_RELATIVE` (module doc)."""
    assert set(grads) == set(expected), what
    if bf16:
        found, wanted = (torch.cat([g[n].flatten() for n in grads]) for g in (grads, expected))
        assert (found - wanted).norm() <= BF16_RELATIVE * wanted.norm(), what
        return
    floor = 1e-6 * max(g.norm() for g in expected.values())
    for name, grad in grads.items():
        assert (grad - expected[name]).norm() <= RELATIVE * expected[name].norm() + floor, f"{name} {what}"


# -- the mechanism on a world of one real gloo group (no torchrun) ----------------------------


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_failed_step_puts_the_earlier_gradients_back_and_a_retry_accumulates_onto_them(world_of_one, zero):
    """What `runner.step` does around its executor, with one bucket of a Linear: a step that
    fails after its backward (before its reduction) leaves the first step's gradient, and the
    retried step adds to it; `zero_grad` (ZeRO: `forget_reduced`) then starts afresh."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    group = RankGroup(axis=Axis.DP, ranks=(0,), handle=world_of_one)
    bucket = Bucket(index=0, parameters=("bias", "weight"), numel=15, dtype=torch.float32)
    buckets = GradientBuckets((bucket,), dict(layer.named_parameters()), group, Communicator(timedelta(seconds=10)),
                              {}, zero=zero)
    context = SimpleNamespace(buckets=(buckets,), modules=(layer,))
    inputs = torch.randn(3, 5, 4)

    def step(x: torch.Tensor, *, fail: bool = False) -> None:
        earlier = EarlierGradients.set_aside(context)
        buckets.start_step(1)
        layer(x).square().sum().backward()
        if fail:  # e.g. a collective that times out: the bucket is never reduced
            earlier.put_back()
            return
        buckets.finish_bucket(0)
        earlier.add_back()

    def gradient() -> torch.Tensor:
        if zero:
            return buckets.shard_gradient(0)[: bucket.numel]
        return torch.cat([layer.bias.grad.reshape(-1), layer.weight.grad.reshape(-1)])

    def one_device(*xs: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(sum(layer(x).square().sum() for x in xs), (layer.bias, layer.weight))
        return torch.cat([g.reshape(-1) for g in grads])

    step(inputs[0])
    step(inputs[1], fail=True)
    torch.testing.assert_close(gradient(), one_device(inputs[0]), rtol=1e-6, atol=1e-6)
    step(inputs[1])
    torch.testing.assert_close(gradient(), one_device(inputs[0], inputs[1]), rtol=1e-6, atol=1e-6)
    layer.zero_grad()
    buckets.forget_reduced(set_to_none=True)
    step(inputs[2])
    torch.testing.assert_close(gradient(), one_device(inputs[2]), rtol=1e-6, atol=1e-6)
    buckets.remove()
