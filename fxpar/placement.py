"""Placements: how one value of the global program lies across the ranks of a mesh axis.

    Replicate()        every rank holds the whole tensor
    Shard(dim)         rank i holds the i-th of `size` equal slices along `dim`
    Shard(dim, parts)  the same, for a dim made of `parts` equal blocks (a fused q|k|v
                       projection): rank i holds the i-th slice of *each* block, side by side
    Partial()          every rank holds a summand; the value is their sum

Placements are data on graph nodes (`fxpar.meta.placement`). The tensor-parallel pass derives
them op by op (`passes.tp_propagation`) and, where an op needs its input laid out otherwise,
inserts the op that `fxpar.redistribution`'s table names for the move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    parts: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.parts == 1 else f"S({self.dim}, parts={self.parts})"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial
R, P = Replicate(), Partial()


def local_shape(shape: tuple[int, ...] | list[int], placement: Placement, size: int) -> tuple[int, ...]:
    """The shape of one rank's piece of a value of global `shape` under `placement` over `size`
    ranks: a Shard's dim divided, anything else whole (a Partial's summand has the value's shape)."""
    shape = tuple(shape)
    if not isinstance(placement, Shard) or size == 1:
        return shape
    return (*shape[:placement.dim], shape[placement.dim] // size, *shape[placement.dim + 1:])


def local_numel(shape: tuple[int, ...] | list[int], placement: Placement, size: int) -> int:
    return math.prod(local_shape(shape, placement, size))


def local_slice(tensor: torch.Tensor, placement: Placement, index: int, size: int) -> torch.Tensor:
    """Rank `index`'s piece of the global `tensor` under `placement` over `size` ranks."""
    if not isinstance(placement, Shard) or size == 1:
        return tensor
    dim, parts = placement.dim, placement.parts
    if tensor.shape[dim] % (parts * size):
        raise ValueError(
            f"dim {dim} of size {tensor.shape[dim]} does not split into {parts} x {size} pieces"
        )
    blocks = tensor.chunk(parts, dim=dim)
    return torch.cat([block.chunk(size, dim=dim)[index] for block in blocks], dim=dim)


def global_tensor(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The global tensor from every rank's piece, in rank order (inverse of `local_slice`)."""
    if not isinstance(placement, Shard) or len(pieces) == 1:
        return pieces[0]
    dim, parts = placement.dim, placement.parts
    per_rank_blocks = [piece.chunk(parts, dim=dim) for piece in pieces]
    return torch.cat(
        [torch.cat([blocks[b] for blocks in per_rank_blocks], dim=dim) for b in range(parts)], dim=dim
    )
