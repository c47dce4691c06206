"""One rank's pieces of the training state, as chunks of global tensors under the model's names.

A `torch.distributed.checkpoint` (DCP) checkpoint stores each global tensor as chunks,
rectangles (offsets, sizes) in the tensor's global coordinates, each written by one rank that
holds it; loading asks, for every chunk a rank holds now, for the overlapping parts of the
saved ones. So a checkpoint reshards across plans when each rank describes what it holds in
global coordinates. This module does that, from the placements (`placement.local_intervals`
is the one source of where a shard lies):

    key                                   global tensor           this rank's pieces
    transformer.h.0.attn.q.weight         the parameter           its local_intervals (tp), and
                                                                  under ZeRO-3 the flat_range of
                                                                  them its FlatShard piece keeps
    optim.state.<name>.exp_avg            shaped as <name>        the same; under ZeRO-1/2 the
                                                                  part of this rank's flat shard
                                                                  that falls in <name>
    optim.state.<name>.step               0-dim                   whole (every holder the same)

A ZeRO-1/2 shard is a contiguous range of a bucket's flat buffer, and a ZeRO-3 piece one of the
parameter's own flattened (tp) piece, so within one parameter either is a range of row-major
elements, which `row_major_boxes` cuts into rectangles
(a partial first row, whole rows, a partial last row, recursively):

    param (4, 6), flat range [5, 20)     (0, 5):(1, 1)   (1, 0):(2, 6)   (3, 0):(1, 2)

Each `Piece` is a view into the live tensor, so saving copies from it and loading copies into
it: nothing is gathered, and the parameters' flat ZeRO buffers are written in place.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fxpar.ir.placement import AXES, R, FlatShard, Placements, flat_range, local_intervals, local_shape


@dataclass(frozen=True)
class Piece:
    """`view` holds the global tensor's elements at `offsets` (sizes: the view's shape)."""

    offsets: tuple[int, ...]
    view: torch.Tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.view.shape)


@dataclass
class GlobalTensor:
    """A tensor of the checkpoint by its global `shape`, and the pieces this rank holds."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)


def tensor_pieces(local: torch.Tensor, shape: Sequence[int], placements: Placements, coord: Mapping[str, int],
                  sizes: Mapping[str, int]) -> list[Piece]:
    """The pieces of a rank's local tensor `local` of a value of global `shape` under
    `placements`: its intervals (`placement.local_intervals`), or under a FlatShard (ZeRO-3's
    parameters) the part of the flattened piece it keeps (`placement.flat_range`; the zero
    padding after it belongs to no element)."""
    unflat = Placements(**{axis: R if isinstance(placements[axis], FlatShard) else placements[axis] for axis in AXES})
    piece_shape = tuple(int(d) for d in local_shape(shape, unflat, sizes))
    kept = flat_range(math.prod(piece_shape), placements, coord, sizes)
    if kept is None:
        return _pieces(local, (0,) * local.dim(), _intervals(shape, placements, coord, sizes))
    start, stop = kept
    return flat_range_pieces(local.reshape(-1)[: stop - start], start, piece_shape, unflat, coord, sizes, shape)


def flat_range_pieces(flat: torch.Tensor, start: int, local_shape: Sequence[int], placements: Placements,
                      coord: Mapping[str, int], sizes: Mapping[str, int], shape: Sequence[int]) -> list[Piece]:
    """The pieces of `flat`, elements `start ... start + len(flat)` of a rank's local tensor
    of `local_shape` (of a value of global `shape`) flattened row-major: a ZeRO shard's part
    of one parameter."""
    intervals = _intervals(shape, placements, coord, sizes)
    strides = [math.prod(local_shape[d + 1:]) for d in range(len(local_shape))]
    pieces = []
    for offsets, box in row_major_boxes(tuple(local_shape), start, start + flat.numel()):
        first = sum(o * s for o, s in zip(offsets, strides)) - start
        view = flat[first : first + math.prod(box)].view(box)
        pieces.extend(_pieces(view, offsets, intervals))
    return pieces


def row_major_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangles (offsets, sizes) covering elements `start ... stop` of a row-major tensor of
    `shape`, in order; each is contiguous in memory (module doc)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    boxes = []
    if start % row:  # a partial first row
        r, end = start // row, min(stop, (start // row + 1) * row)
        boxes += [((r, *o), (1, *s)) for o, s in row_major_boxes(shape[1:], start - r * row, end - r * row)]
        start = end
    whole = (stop - start) // row if start < stop else 0
    if whole:
        boxes.append(((start // row, *(0,) * (len(shape) - 1)), (whole, *shape[1:])))
        start += whole * row
    if start < stop:  # a partial last row
        r = start // row
        boxes += [((r, *o), (1, *s)) for o, s in row_major_boxes(shape[1:], 0, stop - r * row)]
    return boxes


def _intervals(shape, placements, coord, sizes) -> list[list[tuple[int, int, int]]]:
    """Per dim, (local start, global start, length) of each range the rank's piece holds."""
    result = []
    for ranges in local_intervals(shape, placements, coord, sizes):
        local, dim_ranges = 0, []
        for start, n in ranges:
            dim_ranges.append((local, start, n))
            local += n
        result.append(dim_ranges)
    return result


def _pieces(view: torch.Tensor, local_offsets: Sequence[int], intervals) -> list[Piece]:
    """`view` (the local box at `local_offsets`) cut where its dims cross the intervals, each
    part with its global offsets."""
    per_dim = []
    for d, ranges in enumerate(intervals):
        lo, hi, parts = local_offsets[d], local_offsets[d] + view.shape[d], []
        for local, start, n in ranges:
            a, b = max(lo, local), min(hi, local + n)
            if a < b:
                parts.append((a - lo, start + a - local, b - a))
        per_dim.append(parts)
    pieces = []
    for combination in itertools.product(*per_dim):
        piece = view
        for d, (at, _, n) in enumerate(combination):
            if n != view.shape[d]:
                piece = piece.narrow(d, at, n)
        pieces.append(Piece(tuple(start for _, start, _ in combination), piece))
    return pieces
