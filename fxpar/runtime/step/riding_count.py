"""The step's count of valid targets as digits riding in a float gradient bucket.

Where the count rides in dp's first gradient bucket (`lowering.ride_agreements`), each rank
writes its count of valid targets into the bucket's count slots and the all-reduce sums them
with the gradients. A float32 slot holds integers exactly only below 2**24, and a step may
count more targets than that, so the count goes in base-4096 digits, least significant last:
each digit is below 4096, so a digit summed over up to 4096 ranks stays below 2**24, and two
slots hold exactly up to 2**36 targets a step (`lowering.COUNT_SLOTS`, `COUNT_RIDES_UP_TO`). The sum
of the digits, read back in int64, is the sum of the counts.
"""

from __future__ import annotations

import functools

import torch

BASE = 4096


def digits(count: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` (an integer tensor on the bucket's device) as `slots` base-4096 digits in
    `dtype`, most significant first (that one not reduced modulo 4096, so no count is cut);
    no host synchronisation."""
    digits_ = count.to(torch.int64) // _places(slots, count.device)
    digits_[1:] %= BASE
    return digits_.to(dtype)


def number(summed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The integer (int64, on the device) whose digits, summed over the ranks, are
    `summed[start:end]`: the sum of the ranks' counts."""
    return (summed[start:end].to(torch.int64) * _places(end - start, summed.device)).sum()


@functools.cache
def _places(slots: int, device: torch.device) -> torch.Tensor:
    """[4096**(slots-1), ..., 4096, 1] on `device` (made once: a step's few small ops count)."""
    return torch.tensor([BASE**k for k in range(slots - 1, -1, -1)], dtype=torch.int64, device=device)
