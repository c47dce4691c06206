"""Process groups: the default group and this rank's group on each mesh axis.

Every group gets the same finite timeout, so a collective that never completes (a peer died
or stopped issuing collectives) fails on every other rank instead of hanging. All ranks create
every group of every axis in the same order, as `torch.distributed.new_group` requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from fxpar.mesh import Axis, Mesh


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
    def name(self) -> str:
        axis = self.axis.value if self.axis is not None else "point-to-point"
        return f"{axis} group {list(self.ranks)}"


def init_process_groups(
    mesh: Mesh, *, rank: int, backend: str, timeout: timedelta, device_id=None,
    extra: tuple[tuple[int, ...], ...] = (),
) -> tuple[dict[Axis, RankGroup], dict[tuple[int, ...], RankGroup]]:
    """Initialise torch.distributed; return this rank's group on each mesh axis, and those of
    the `extra` groups (tied-parameter owners) that contain it."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=mesh.world_size,
            timeout=timeout,
            device_id=device_id,
        )
    mine: dict[Axis, RankGroup] = {}
    for axis in Axis:
        for ranks in mesh.groups(axis):
            if len(ranks) == 1:
                handle = None
            elif len(ranks) == mesh.world_size:
                handle = dist.group.WORLD
            else:
                handle = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if rank in ranks:
                mine[axis] = RankGroup(axis=axis, ranks=ranks, handle=handle, rank=rank)
    others = {}
    for ranks in extra:
        handle = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if rank in ranks:
            others[ranks] = RankGroup(axis=None, ranks=ranks, handle=handle, rank=rank)
    return mine, others
