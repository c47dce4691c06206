"""The communicator's reduce-scatter on gloo, composed of an all-to-all and a local sum
(`runtime.communicator._reduce_scatter`), against its definition: the sum over the ranks of
their tensors, this rank's dim-0 block of it. Ranks are threads of this process, each with a
gloo ProcessGroup of its own on one store (no launch)."""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fxpar.ir.mesh import Axis
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import RankGroup

TIMEOUT = timedelta(seconds=30)


def on_threads(world: int, body) -> list:
    """`body(group, communicator)` on `world` gloo ranks, one thread each; their results."""
    store, results, errors = dist.HashStore(), [None] * world, []

    def rank(r: int) -> None:
        try:
            handle = dist.ProcessGroupGloo(store, r, world, TIMEOUT)
            group = RankGroup(axis=Axis.DP, ranks=tuple(range(world)), handle=handle, rank=r)
            results[r] = body(group, Communicator(TIMEOUT))
        except Exception as error:  # raised again on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def tensor_of(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(12, 3, generator=torch.Generator().manual_seed(rank)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_reduce_scatter_is_each_ranks_block_of_the_sum(world, dtype):
    def body(group, communicator):
        tensor = tensor_of(group.index, dtype)
        out = torch.empty(12 // world, 3, dtype=dtype)
        communicator.reduce_scatter(out, tensor, group, tag="bucket 0").wait()
        in_place = tensor.clone()  # the output a slice of the input: the reduction in place
        mine = in_place[group.index * (12 // world) : (group.index + 1) * (12 // world)]
        communicator.reduce_scatter_now(mine, in_place, group, tag="bucket 1", phase="backward")
        return out, mine, communicator.stats()

    results = on_threads(world, body)
    total = torch.stack([tensor_of(r, dtype) for r in range(world)]).sum(0)  # in rank order
    for r, (out, in_place, stats) in enumerate(results):
        block = total[r * (12 // world) : (r + 1) * (12 // world)]
        assert torch.equal(out, block) and torch.equal(in_place, block)
        # counted as what it is, a reduce-scatter of the whole input (the cost model's payload)
        assert stats == {"reduce_scatter": {"count": 2, "bytes": 2 * 36 * dtype.itemsize}}
