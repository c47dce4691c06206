"""The job's one seed, agreed at bind: what every rank's random ops draw from.

    bind()            rank 0's `torch.initial_seed()`: the seed the script gave
                      `torch.manual_seed` (the same call that makes every rank build the same
                      initial weights), whatever seed the other processes set (a script that
                      seeds `base + rank` still draws one job's masks)
    bind(seed=1234)   that seed; every rank must pass the same one (a BindError on all ranks
                      otherwise, since masks drawn from two seeds silently break the
                      equalities tensor parallelism relies on)

One scalar collective over the whole world, at bind, outside any step (so in no step program).
`fxpar.ops.random_streams` derives each op's generator from it.
"""

from __future__ import annotations

import torch

from fxpar.errors import BindError
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import world_group

_SEED_RANGE = 2**63  # torch.initial_seed() is a uint64; the collective carries an int64


def check_seed(seed: object) -> None:
    """A BindError unless `seed` is None or an int in [0, 2**63) (checked before any group)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_RANGE):
        raise BindError(f"bind(seed={seed!r}): a seed is an int in [0, 2**63). Fix: bind(seed=0), or leave it out")


def agree_seed(seed: int | None, *, rank: int, world_size: int, communicator: Communicator,
               device: torch.device) -> int:
    """The job's seed (module doc), the same on every rank."""
    check_seed(seed)
    own = torch.initial_seed() % _SEED_RANGE if seed is None else seed
    if world_size == 1:
        return own
    world = world_group(rank)
    if seed is None:
        value = torch.tensor([own], dtype=torch.int64, device=device)
        communicator.broadcast(value, world, tag="the job's random seed", log=False)
        return int(value)
    # The largest and the smallest seed in one all-reduce: every rank learns whether they agree.
    extremes = torch.tensor([own, -own], dtype=torch.int64, device=device)
    communicator.all_reduce_now(extremes, world, tag="the job's random seed", op="max", phase="step")
    largest, smallest = int(extremes[0]), -int(extremes[1])
    if largest != smallest:
        raise BindError(
            f"bind(seed=...) was given different seeds on different ranks (from {smallest} to "
            f"{largest}; this rank passed {seed}): one job draws its dropout masks from one "
            "seed, or tensor-parallel ranks' copies of replicated values drift apart. Fix: pass "
            "the same seed on every rank, or none (rank 0's torch.manual_seed is used)"
        )
    return seed
