"""Placements: how one value of the global program lies across the ranks of a mesh axis.

    Replicate()        every rank holds the whole tensor
    Shard(dim)         rank i holds the i-th of `size` equal slices along `dim`
    Shard(dim, parts)  the same, for a dim made of `parts` equal blocks (a fused q|k|v
                       projection): rank i holds the i-th slice of *each* block, side by side;
                       `parts` a tuple of widths for unequal blocks: (2, 1, 1) is Phi-3's
                       grouped-query q|k|v, 4 query heads beside 2 key and 2 value heads
    Partial()          every rank holds a summand; the value is their sum
    FlatShard()        rank i holds the i-th of `size` equal pieces of the value flattened
                       (after every other axis has taken its piece) and zero-padded to a
                       multiple of `size`: ZeRO-3's parameters on the dp axis, which need no
                       divisible dim and nest inside a tensor-parallel shard

A value carries one placement per mesh axis that splits data, `Placements(dp=..., cp=..., tp=...)`
(and `ep=`, on which an expert's weights are split: dp's other placement then holds within
the ranks that hold the same experts)
(DTensor's `placements`, by axis name). The pipeline axis is not among them: which stage
computes a value is its own annotation (`fxpar.ir.meta.STAGE`), since a stage's values live on
one pipeline rank whole rather than split across the axis.

    parameter of a column-parallel linear     Placements(dp=R, tp=S(0))
    activation (batch, seq, hidden)            Placements(dp=S(0), tp=R)
    the loss, a sum over the batch             Placements(dp=P, tp=R)

Placements are data on graph nodes (`fxpar.ir.meta.placements`). The tensor-parallel pass derives
the tp axis op by op (`passes.tensor_parallel.propagation`) and, where an op needs its input laid out
otherwise, inserts the op that `fxpar.ops.redistribution`'s table names for the move; the
data-parallel pass derives the dp axis (`passes.dp_placement.place_data_parallel`).

`local_shape` (and `local_numel`, `local_slice`, `local_intervals`, `flat_range`) is the one
place that turns a global shape into one rank's piece: nothing else divides by a degree.
`global_shape` is its inverse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import sympy
import torch


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    parts: int | tuple[int, ...] = 1  # equal blocks, or the relative widths of unequal ones

    def __str__(self) -> str:
        if not self.fused:
            return f"S({self.dim})"
        return f"S({self.dim}, parts={self.parts if isinstance(self.parts, int) else ':'.join(map(str, self.parts))})"

    @property
    def widths(self) -> tuple[int, ...]:
        """The relative widths of the dim's blocks: (1, 1, 1) for `parts=3`."""
        return (1,) * self.parts if isinstance(self.parts, int) else self.parts

    @property
    def fused(self) -> bool:
        """Whether the dim is made of blocks that each rank holds a slice of."""
        return len(self.widths) > 1

    def block_sizes(self, length: int) -> list[int]:
        """The sizes of the blocks of a dim of `length` elements (ints)."""
        return [length * w // sum(self.widths) for w in self.widths]

    def divides(self, length: int, size: int) -> bool:
        """Whether every block of a dim of `length` splits into `size` equal slices."""
        return length % sum(self.widths) == 0 and all(b % size == 0 for b in self.block_sizes(length))


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class FlatShard:
    def __str__(self) -> str:
        return "F"


Placement = Replicate | Shard | Partial | FlatShard
R, P = Replicate(), Partial()


PlacementAxis = Literal["dp", "ep", "cp", "tp"]
AXES: tuple[PlacementAxis, ...] = ("dp", "ep", "cp", "tp")  # outermost first, as the mesh orders them


@dataclass(frozen=True)
class Placements:
    """A value's placement on every mesh axis that splits data (module doc)."""

    dp: Placement = R
    tp: Placement = R
    cp: Placement = R  # context parallelism's sequence shards (`passes.context_parallel`)
    ep: Placement = R  # expert parallelism's expert shards (`passes.expert_parallel`)

    def __getitem__(self, axis: PlacementAxis) -> Placement:
        return getattr(self, axis)

    def on(self, axis: PlacementAxis, placement: Placement) -> Placements:
        """These placements with `axis` set to `placement`."""
        return replace(self, **{axis: placement})

    def __str__(self) -> str:
        """`dp=S(0) tp=R`, and cp and ep where they are not replicated: `dp=S(0) cp=S(1) tp=R`."""
        return " ".join(f"{axis}={self[axis]}" for axis in AXES if axis not in ("cp", "ep") or self[axis] != R)


REPLICATED = Placements()
Sizes = Mapping[str, int]  # mesh axis -> its degree; a Mesh gives `mesh.sizes()`


def local_shape(shape, placements: Placements, sizes: Sizes) -> tuple:
    """The shape of one rank's piece of a value of global `shape` (ints or sympy expressions)
    under `placements` on a mesh of axis `sizes`: each Shard's dim divided by its axis' degree,
    anything else whole (a Partial's summand has the value's shape); a FlatShard, last, makes
    it the flat piece of `flat_piece`."""
    shape = list(shape)
    for axis in AXES:
        placement, size = placements[axis], sizes.get(axis, 1)
        if isinstance(placement, Shard) and size > 1:
            d = shape[placement.dim]
            shape[placement.dim] = d // size if isinstance(d, int) else sympy.sympify(d) / size
    for axis in AXES:
        if isinstance(placements[axis], FlatShard) and sizes.get(axis, 1) > 1:
            shape = [flat_piece(math.prod(shape), sizes[axis])]
    return tuple(shape)


def flat_piece(numel: int, size: int) -> int:
    """Elements of one rank's FlatShard piece of `numel` elements over `size` ranks."""
    return -(-numel // size)


def global_shape(shape, placements: Placements, sizes: Sizes) -> tuple:
    """The global shape of a value whose piece on one rank has `shape` (inverse of `local_shape`)."""
    if any(isinstance(placements[axis], FlatShard) and sizes.get(axis, 1) > 1 for axis in AXES):
        raise ValueError("a FlatShard piece does not say its value's shape: read the value's own")
    shape = list(shape)
    for axis in AXES:
        placement, size = placements[axis], sizes.get(axis, 1)
        if isinstance(placement, Shard):
            shape[placement.dim] = shape[placement.dim] * size
    return tuple(shape)


def local_numel(shape, placements: Placements, sizes: Sizes):
    return math.prod(local_shape(shape, placements, sizes))


def local_intervals(shape, placements: Placements, coord: Mapping[str, int], sizes: Sizes) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Where the piece of the rank at mesh coordinate `coord` lies in a value of global
    `shape` (ints), before any FlatShard flattens it (`flat_range` says which of the piece's
    elements that keeps): per dim, the (global start, length) ranges the piece holds, in the
    order the piece lays them out. One range per dim, except a Shard with parts > 1 (each
    block's slice), or several axes sharding one dim (the inner axis slices the outer one's):

        shape (12, 4), tp=Shard(0, parts=3), rank 1 of 2     dim 0: (2, 2) (6, 2) (10, 2)

    What a checkpoint writes as one rank's chunks; `local_slice` cuts the piece by it."""
    ranges = [((0, int(d)),) for d in shape]
    for axis in AXES:
        placement, size = placements[axis], sizes.get(axis, 1)
        if isinstance(placement, Shard) and size > 1:
            ranges[placement.dim] = _shard_ranges(ranges[placement.dim], placement, coord[axis], size)
    return tuple(ranges)


def _shard_ranges(ranges, placement: Shard, index: int, size: int) -> tuple[tuple[int, int], ...]:
    """The rank `index` of `size`'s part of a dim already laid out as `ranges`: the index-th
    of `size` equal slices of each of the dim's blocks, mapped back to global ranges."""
    length = sum(n for _, n in ranges)
    if not placement.divides(length, size):
        raise ValueError(f"dim {placement.dim} of size {length} does not split into {size} "
                         f"slices of each of its blocks ({placement})")
    result, block_start = [], 0
    for block in placement.block_sizes(length):
        piece = block // size
        want_start, want_stop = block_start + index * piece, block_start + (index + 1) * piece
        block_start += block
        local = 0  # where each range starts in the piece being sliced
        for start, n in ranges:
            lo, hi = max(want_start, local), min(want_stop, local + n)
            if lo < hi:
                result.append((start + lo - local, hi - lo))
            local += n
    return tuple(result)


def flat_range(numel: int, placements: Placements, coord: Mapping[str, int], sizes: Sizes) -> tuple[int, int] | None:
    """Under a FlatShard: which elements (start, stop) of the other axes' piece of `numel`
    elements, flattened, the rank's flat piece holds (the piece has `flat_piece` elements, the
    ones past `stop` zero padding); None without a FlatShard."""
    for axis in AXES:
        size = sizes.get(axis, 1)
        if isinstance(placements[axis], FlatShard) and size > 1:
            piece = flat_piece(numel, size)
            return min(coord[axis] * piece, numel), min((coord[axis] + 1) * piece, numel)
    return None


def local_slice(tensor: torch.Tensor, placements: Placements, coord: Mapping[str, int], sizes: Sizes) -> torch.Tensor:
    """The piece of the global `tensor` that the rank at mesh coordinate `coord` (axis ->
    index) holds under `placements`: its `local_intervals` cut and put side by side, then
    under a FlatShard its `flat_range` of that, zero-padded to `flat_piece` elements."""
    for dim, ranges in enumerate(local_intervals(tensor.shape, placements, coord, sizes)):
        if ranges != ((0, tensor.shape[dim]),):
            tensor = torch.cat([tensor.narrow(dim, start, n) for start, n in ranges], dim=dim)
    for axis in AXES:
        size = sizes.get(axis, 1)
        if isinstance(placements[axis], FlatShard) and size > 1:
            start, stop = flat_range(tensor.numel(), placements, coord, sizes)
            piece, flat = flat_piece(tensor.numel(), size), tensor.reshape(-1)[start:stop]
            tensor = torch.cat([flat, flat.new_zeros(piece - flat.numel())]) if flat.numel() < piece else flat
    return tensor


def global_tensor(pieces: list[torch.Tensor], placement: Placement, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor whole along one axis from every rank's piece on it, in axis order (the
    inverse of `local_slice` on that axis; gathering the full state goes axis by axis, a
    FlatShard, innermost, first: back to `shape`, the value's piece on the other axes)."""
    if isinstance(placement, FlatShard):
        if shape is None:
            raise ValueError("a FlatShard's pieces need the shape they flattened")
        return torch.cat([p.reshape(-1) for p in pieces])[: math.prod(shape)].view(shape)
    if not isinstance(placement, Shard) or len(pieces) == 1:
        return pieces[0]
    dim = placement.dim
    local_blocks = placement.block_sizes(pieces[0].shape[dim])
    per_rank_blocks = [piece.split(local_blocks, dim=dim) for piece in pieces]
    return torch.cat(
        [torch.cat([blocks[b] for blocks in per_rank_blocks], dim=dim) for b in range(len(local_blocks))], dim=dim
    )
