"""Process groups: the default group and this rank's group on each mesh axis.

Every group gets the same finite timeout, so a collective that never completes (a peer died
or stopped issuing collectives) fails on every other rank instead of hanging. All ranks create
every group of every axis in the same order, as `torch.distributed.new_group` requires.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from fxpar.errors import BindError, clipped
from fxpar.ir.collectives import channel_of
from fxpar.ir.mesh import Axis, Mesh
from fxpar.runtime.collective_failures import describe_failure


@dataclass(frozen=True)
class RankGroup:
    """One process group seen from one rank: its global ranks and the handle."""

    axis: Axis | None  # None for a pair of pipeline peers or a tied-parameter group
    ranks: tuple[int, ...]
    handle: dist.ProcessGroup | None  # None when unbound, or when the group has this rank alone
    rank: int = 0  # the global rank that holds this view

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's position in the group (its coordinate on the axis)."""
        return self.ranks.index(self.rank)

    @property
    def channel(self) -> str:
        """Its communicator family (`ir.collectives.channel_of`): an expert group's own."""
        return channel_of(self.axis.value if self.axis is not None else None)

    @property
    def name(self) -> str:
        axis = self.axis.value if self.axis is not None else "point-to-point"
        return f"{axis} group {list(self.ranks)}"


def world_group(rank: int) -> RankGroup:
    """Every rank of the job, seen from `rank`: for the calls outside any step that all ranks
    make together (the seed agreement, the gradient norm)."""
    return RankGroup(axis=None, ranks=tuple(range(dist.get_world_size())), handle=dist.group.WORLD, rank=rank)


def init_process_groups(
    mesh: Mesh, *, rank: int, backend: str, timeout: timedelta, device_id=None,
    extra: tuple[tuple[int, ...], ...] = (),
) -> tuple[dict[Axis, RankGroup], dict[tuple[int, ...], RankGroup]]:
    """Initialise torch.distributed; return this rank's group on each mesh axis, and those of
    the `extra` groups (tied-parameter owners) that contain it.

    Creating a group waits for every rank of the world (the store counts them in): when one has
    exited or binds another program, this raises BindError naming the group, the time waited
    and the cause (`runtime.collective_failures`), not the store's own error.
    """
    global _default_groups_created
    world = tuple(range(mesh.world_size))
    if not dist.is_initialized():
        with _creating("the default process group (every rank)", world, rank, timeout):
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=mesh.world_size,
                timeout=timeout,
                device_id=device_id,
                store=_fresh_store(rank, mesh.world_size, timeout),
            )
        _default_groups_created += 1
    mine: dict[Axis, RankGroup] = {}
    for axis in Axis:
        own = channel_of(axis.value) != ""  # a communicator of its own, even over all ranks
        if own and mesh.ep == 1:
            continue  # no expert groups
        for ranks in mesh.groups(axis):
            if len(ranks) == 1:
                handle = None
            elif len(ranks) == mesh.world_size and not own:
                handle = dist.group.WORLD
            else:
                with _creating(f"the {axis.value} group {list(ranks)}", world, rank, timeout):
                    handle = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if rank in ranks:
                mine[axis] = RankGroup(axis=axis, ranks=ranks, handle=handle, rank=rank)
    others = {}
    for ranks in extra:
        with _creating(f"the tied-parameter group {list(ranks)}", world, rank, timeout):
            handle = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if rank in ranks:
            others[ranks] = RankGroup(axis=None, ranks=ranks, handle=handle, rank=rank)
    return mine, others


# [Note: binding again after close] `destroy_process_group` resets torch's group counter, so
# a second `init_process_group` in the process names its groups as the first did and meets the
# first's keys, still in torchrun's store: a rank may read its peer's old address and connect
# to nothing (pytorch/pytorch#55967; here a bind after close timed out one run in three).
# Every default group after the first gets its own key prefix, the same on every rank because
# all ranks bind and close in step.
#
# The same happens across torchrun's restarts (`--max-restarts`): the elastic agent keeps one
# TCP store for every attempt (its shared rendezvous store), and torch's env:// rendezvous adds
# no per-attempt prefix, so a restarted rank may read a dead rank's address from the attempt
# before (seen here: "Connection refused" at once, or gloo's connect waiting past the group's
# timeout). A restarted job's groups live under the attempt's number (TORCHELASTIC_RESTART_COUNT,
# the same on every rank of an attempt).
_default_groups_created = 0


def _fresh_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """None for the process's first default group on torchrun's first attempt (torch's own
    env:// rendezvous), else the env:// store under a prefix no earlier group or attempt used
    ([Note: binding again after close])."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if _default_groups_created == 0 and attempt == "0":
        return None
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"fxpar/attempt{attempt}/bind{_default_groups_created}", store)


@contextmanager
def _creating(what: str, world: tuple[int, ...], rank: int, timeout: timedelta) -> Iterator[None]:
    """Turn a failure to create `what` into a BindError that says why (module doc)."""
    start = time.perf_counter()
    try:
        yield
    except Exception as error:
        cause = describe_failure(error, ranks=world, rank=rank,
                                 waited=time.perf_counter() - start, timeout=timeout)
        raise BindError(
            f"program.bind() on rank {rank} could not create {clipped(what)}: creating it "
            f"{cause}. Every rank must bind the same program at the same point; a peer that "
            "exited or stopped earlier leaves the others here"
        ) from error
