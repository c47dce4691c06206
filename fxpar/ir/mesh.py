"""The device mesh as pure data: rank <-> coordinates, and the ranks that share a process group.

Map of this module:

- `Axis`        the mesh axes: data, pipeline, context, tensor (`LAYOUT`, outermost first, lay
                out the ranks), and expert and expert-data, two ways of cutting the data axis
- `Coord`       one rank's position on the mesh: `Coord(dp=1, pp=0, tp=1)` (`cp=0` by default)
- `Mesh`        the degrees, with `coord(rank)`, `rank(coord)`, `group(rank, axis)`, `groups(axis)`

No process group is created here: the runtime builds one group per tuple that `groups(axis)`
returns, so the compiler can reason about rank 517 of a 1024-rank job on a laptop.

Rank order (docs/design.md, "Mesh and ranks") puts tensor parallelism innermost, where links are
fastest, then context parallelism (its key and value gathers run in every attention layer:
within a node too, as torchtitan lays cp next to tp), then pipeline, then data::

    rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i

so for `Mesh(dp=2, pp=2, tp=2)`::

    rank  dp  pp  tp
       0   0   0   0      tp groups: (0, 1) (2, 3) (4, 5) (6, 7)   neighbouring ranks
       1   0   0   1      pp groups: (0, 2) (1, 3) (4, 6) (5, 7)   stride tp
       2   0   1   0      dp groups: (0, 4) (1, 5) (2, 6) (3, 7)   stride pp * tp
       3   0   1   1
       4   1   0   0
       5   1   0   1
       6   1   1   0
       7   1   1   1

Expert parallelism is carved from the data-parallel ranks (Megatron-Core's and torchtitan's
layout): with `ep` dividing `dp`, the dp ranks `dp_i` fall into expert groups of `ep`
neighbours (`dp_i // ep` in common) that split the experts between them, and the ranks that
hold the same experts (`dp_i % ep` in common) form the expert-data groups over which those
experts' gradients are summed. For `Mesh(dp=4, ep=2)`: ep groups (0, 1) (2, 3), edp groups
(0, 2) (1, 3). Neither adds ranks: `world_size` is still `dp * pp * cp * tp`.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fxpar.plan.plan import Plan


class Axis(enum.Enum):
    """A mesh axis: the four of `LAYOUT`, and the two cuts of dp that expert parallelism makes."""

    DP = "dp"
    PP = "pp"
    CP = "cp"
    TP = "tp"
    EP = "ep"  # the dp ranks that split the experts between them
    EDP = "edp"  # the dp ranks that hold the same experts


# The axes that lay out the ranks, outermost first; their degrees multiply to the world size.
LAYOUT = (Axis.DP, Axis.PP, Axis.CP, Axis.TP)


@dataclass(frozen=True)
class Coord:
    """A rank's index along each axis; `coord[Axis.TP]` is the same as `coord.tp`."""

    dp: int
    pp: int
    tp: int
    cp: int = 0  # last, so that a mesh without context parallelism reads as before
    ep_degree: int = field(default=1, compare=False, repr=False)  # the mesh's, for the cuts of dp

    def __getitem__(self, axis: Axis) -> int:
        axis = Axis(axis)
        if axis is Axis.EP:
            return self.dp % self.ep_degree
        if axis is Axis.EDP:
            return self.dp // self.ep_degree
        return getattr(self, axis.value)


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """`dp * pp * cp * tp` ranks laid out with tensor parallelism innermost.

    >>> mesh = Mesh(dp=2, tp=4)
    >>> mesh.coord(5), mesh.group(5, Axis.TP), mesh.group(5, Axis.DP)
    (Coord(dp=1, pp=0, tp=1), (4, 5, 6, 7), (1, 5))
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # expert groups carved from dp (module doc)

    def __post_init__(self) -> None:
        for name in (*(axis.value for axis in LAYOUT), "ep"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise ValueError(
                    f"mesh size along {name} must be a positive integer, got {size!r}. "
                    f"Fix: use {name}=1 for an axis the plan does not split."
                )
            object.__setattr__(self, name, int(size))
        if self.dp % self.ep:
            raise ValueError(f"mesh ep={self.ep} must divide dp={self.dp}: expert groups are carved from the dp ranks")

    @classmethod
    def from_plan(cls, plan: Plan) -> Mesh:
        """The mesh of a plan's degrees; a degree the plan does not have yet counts as 1."""
        return cls(**{name: getattr(plan, name, 1) for name in (*(axis.value for axis in LAYOUT), "ep")})

    @property
    def world_size(self) -> int:
        """The number of ranks: `dp * pp * cp * tp`."""
        return math.prod(self.size(axis) for axis in LAYOUT)

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> degree, `{"dp": 2, "pp": 1, "cp": 1, "tp": 2, "ep": 1, "edp": 2}`:
        what `placement.local_shape` reads."""
        return {axis.value: self.size(axis) for axis in Axis}

    def size(self, axis: Axis) -> int:
        """The number of ranks along `axis` (its degree)."""
        axis = Axis(axis)
        return self.dp // self.ep if axis is Axis.EDP else getattr(self, axis.value)

    def stride(self, axis: Axis) -> int:
        """How far apart in rank two neighbours along `axis` are: tp 1, cp tp, pp cp * tp,
        dp and ep pp * cp * tp, edp ep times that."""
        dp = self.pp * self.cp * self.tp
        return {Axis.DP: dp, Axis.PP: self.cp * self.tp, Axis.CP: self.tp, Axis.TP: 1, Axis.EP: dp,
                Axis.EDP: dp * self.ep}[Axis(axis)]

    def coord(self, rank: int) -> Coord:
        """Where `rank` sits: the inverse of `rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i`."""
        self._check_rank(rank)
        rest, tp_i = divmod(rank, self.tp)
        rest, cp_i = divmod(rest, self.cp)
        dp_i, pp_i = divmod(rest, self.pp)
        return Coord(dp=dp_i, pp=pp_i, tp=tp_i, cp=cp_i, ep_degree=self.ep)

    def rank(self, coord: Coord) -> int:
        """The rank at `coord`: `((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i`."""
        for axis in LAYOUT:
            index = coord[axis]
            if not _is_index(index, self.size(axis)):
                raise ValueError(
                    f"coordinate {axis.value}={index!r} is outside {self}: it must be an integer "
                    f"in 0..{self.size(axis) - 1}."
                )
        return ((coord.dp * self.pp + coord.pp) * self.cp + coord.cp) * self.tp + coord.tp

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """`rank(Coord(dp=dp, pp=pp, tp=tp, cp=cp))`, with 0 for the axes left out."""
        return self.rank(Coord(dp=dp, pp=pp, tp=tp, cp=cp))

    def group(self, rank: int, axis: Axis) -> tuple[int, ...]:
        """The ranks that share every coordinate with `rank` but `axis`, in that axis' order.

        These are the ranks of `rank`'s process group along `axis`; the tuple is sorted.
        """
        stride = self.stride(axis)
        first = rank - self.coord(rank)[axis] * stride
        return tuple(first + index * stride for index in range(self.size(axis)))

    def groups(self, axis: Axis) -> tuple[tuple[int, ...], ...]:
        """Every group along `axis`, ordered by smallest rank; each rank is in exactly one."""
        return tuple(
            self.group(rank, axis)
            for rank in range(self.world_size)
            if self.coord(rank)[axis] == 0
        )

    def position(self, rank: int) -> str:
        """Where `rank` sits, for messages and pictures: "dp 1, pp 0, tp 1" (and cp where the
        mesh has it)."""
        coord = self.coord(rank)
        return ", ".join(f"{axis.value} {coord[axis]}" for axis in self._shown_axes())

    def describe(self, *, max_ranks: int = 64) -> str:
        """A text table of rank -> (dp, pp, tp), and cp where the mesh has it, cut after
        `max_ranks` rows; for docs and logs."""
        width = max(len(str(self.world_size - 1)), 4)
        axes = self._shown_axes()
        lines = [f"{self}", f"{'rank':>{width}}" + "".join(f"{a.value:>4}" for a in axes)]
        for rank in range(min(self.world_size, max_ranks)):
            coord = self.coord(rank)
            lines.append(f"{rank:>{width}}" + "".join(f"{coord[a]:>4}" for a in axes))
        if self.world_size > max_ranks:
            lines.append(f"... (ranks {max_ranks}..{self.world_size - 1} left out)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{a.value}={self.size(a)}" for a in self._shown_axes()) + ")"

    def _shown_axes(self) -> tuple[Axis, ...]:
        """dp, pp and tp always; cp where the mesh splits the sequence, ep where it splits experts."""
        return tuple(a for a in (*LAYOUT, Axis.EP) if getattr(self, a.value) > 1 or a in (Axis.DP, Axis.PP, Axis.TP))

    def _check_rank(self, rank: int) -> None:
        if not _is_index(rank, self.world_size):
            raise ValueError(
                f"rank {rank!r} is not on {self}: ranks are integers 0..{self.world_size - 1}."
            )


def _is_index(value: object, size: int) -> bool:
    """True for an int (not a bool) in 0..size-1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size
