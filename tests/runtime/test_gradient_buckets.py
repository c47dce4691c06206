"""Gradient buckets on a world of one real gloo group: when ZeRO-2's whole gradients exist.

`runtime.state.gradient_buckets` allocates a ZeRO-2 bucket's whole buffer at its first gradient in
backward and frees it once the bucket is reduced, so the forward runs without the whole
gradients and backward holds them bucket by bucket (what `cost.memory.peak_bytes` prices); with two microbatches they accumulate over both backwards and are reduced once, or, reducing
per microbatch (`fxpar.plan.zero_reduction`), each microbatch's are reduced after its backward and
freed, and only the reduced shards accumulate.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from fxpar.ir.buckets import Bucket
from fxpar.ir.mesh import Axis
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.state.gradient_buckets import GradientBuckets


@pytest.fixture
def group(world_of_one):
    return RankGroup(axis=Axis.DP, ranks=(0,), handle=world_of_one)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_zero2_holds_whole_gradients_only_from_the_first_gradient_to_the_reduction(group, microbatches):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    parameters = dict(layer.named_parameters())
    bucket = Bucket(index=0, parameters=("bias", "weight"), numel=15, dtype=torch.float32)
    buckets = GradientBuckets((bucket,), parameters, group, Communicator(timedelta(seconds=10)), {}, zero=2)
    state = buckets.states[0]
    assert state.buffer is None  # nothing whole at bind
    inputs = torch.randn(microbatches, 5, 4)
    buckets.start_step(microbatches)
    assert state.buffer is None and layer.weight.grad is None  # the forward runs without it
    for k in range(microbatches):
        loss = layer(inputs[k]).square().sum()
        if k == 0:
            assert state.buffer is None
        loss.backward()
        assert state.buffer is not None  # allocated at the first gradient, kept to accumulate
    buckets.finish_bucket(0)
    assert state.buffer is None and layer.weight.grad is None  # only the reduced shard is left
    expected = torch.autograd.grad(sum(layer(x).square().sum() for x in inputs), (layer.bias, layer.weight))
    torch.testing.assert_close(buckets.shard_gradient(0), torch.cat([g.reshape(-1) for g in expected]),
                               rtol=1e-6, atol=1e-6)
    buckets.remove()


def test_zero2_per_microbatch_reduces_each_backward_and_keeps_only_the_summed_shard(group):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    parameters = dict(layer.named_parameters())
    bucket = Bucket(index=0, parameters=("bias", "weight"), numel=15, dtype=torch.float32)
    buckets = GradientBuckets((bucket,), parameters, group, Communicator(timedelta(seconds=10)), {},
                              zero=2, per_microbatch=True)
    state = buckets.states[0]
    inputs = torch.randn(3, 5, 4)
    buckets.start_step(3)
    for k in range(3):
        assert state.buffer is None and layer.weight.grad is None  # each forward runs without them
        layer(inputs[k]).square().sum().backward()
        assert state.buffer is not None
        buckets.finish_bucket(0)  # what the step program lists after each backward
    assert state.buffer is None and layer.weight.grad is None
    expected = torch.autograd.grad(sum(layer(x).square().sum() for x in inputs), (layer.bias, layer.weight))
    torch.testing.assert_close(buckets.shard_gradient(0), torch.cat([g.reshape(-1) for g in expected]),
                               rtol=1e-6, atol=1e-6)
    buckets.remove()
