"""The redistribution table: how a value moves from one placement on a mesh axis to another.

A pass that finds a value laid out otherwise than its consumer needs asks `redistribution`
for the op to insert; the op's backward is the dual conversion (`fxpar.ops.distributed`). A
third fact besides the two placements decides: whether the consumer's gradient with respect
to this value is a partial sum over the axis (`into_sharded_math`: a replicated value that
requires grad feeding math whose output is sharded or partial). Megatron's f and g are two
rows of the table, not special cases (Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022,
Sec. 4.2.2 for the sequence-parallel pair):

    have        want        into sharded math   insert              backward
    Partial     Replicate   no                  all_reduce          identity     (g)
    Partial     Shard(d)    no                  reduce_scatter(d)   all-gather   (SP's g)
    Shard(d)    Replicate   no                  all_gather(d)       slice
    Replicate   Shard(d)    no                  split_to_shard(d)   all-gather
    Replicate   Replicate   yes                 copy_to_region      all-reduce   (f)
    Shard(d)    Replicate   yes                 gather_to_region(d) reduce-scatter (SP's f)
    Shard(d)    Shard(e)    no                  via Replicate
    Partial     Replicate   yes                 via Replicate

A fused dim (`Shard(d, parts)` with parts > 1: each rank holds its slice of each of `parts`
blocks, as a fused gate|up or q|k|v projection's output) is not contiguous on any rank, so no
collective moves it as it is. Viewed apart first, it is: `unflatten(d, [parts, -1])` makes it
`Shard(d + 1)` of the blocks, which the rows above move, and `flatten(d, d + 1)` joins the
whole blocks again (row `Unfuse`, inserted by `passes.tensor_parallel.rewrite`; unequal blocks are split
apart, each gathered, and concatenated):

    Shard(d, parts)   Replicate    any               unflatten, the row for Shard(d + 1), flatten
    Shard(d, parts)   Shard(e)     no                via Replicate

Nothing moves a value onto a fused dim: only a fused projection's weights start there.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.ir.placement import Partial, Placement, R, Replicate, Shard
from fxpar.ops.distributed import BY_NAME, DistributedOp


@dataclass(frozen=True)
class Conversion:
    """Insert `op` (on the source's Shard dim, or the destination's, when it takes one)."""

    op: DistributedOp
    dim_from: str | None = None  # "have" or "want": whose Shard dim the op works on


@dataclass(frozen=True)
class Via:
    """Convert to `placement` first, then on from there."""

    placement: Placement


@dataclass(frozen=True)
class Unfuse:
    """Equal blocks: view the fused dim `dim` as (blocks, -1), move them (now `Shard(dim +
    1)`) to Replicate, and view them back as one dim (module doc). Unequal `widths`: split
    the blocks apart, move each (`Shard(dim)`), and concatenate them."""

    dim: int
    widths: tuple[int, ...]

    @property
    def equal(self) -> bool:
        return len(set(self.widths)) == 1


TABLE: dict[tuple[type, type, bool], Conversion | Via] = {
    (Partial, Replicate, False): Conversion(BY_NAME["all_reduce"]),
    (Partial, Shard, False): Conversion(BY_NAME["reduce_scatter"], "want"),
    (Shard, Replicate, False): Conversion(BY_NAME["all_gather"], "have"),
    (Replicate, Shard, False): Conversion(BY_NAME["split_to_shard"], "want"),
    (Replicate, Replicate, True): Conversion(BY_NAME["copy_to_region"]),
    (Shard, Replicate, True): Conversion(BY_NAME["gather_to_region"], "have"),
    (Shard, Shard, False): Via(R),
    (Partial, Replicate, True): Via(R),
}


def redistribution(have: Placement, want: Placement, into_sharded_math: bool) -> Conversion | Via | Unfuse | None:
    """The table's row for this move, or None when there is none (the caller says why)."""
    if have == want and not into_sharded_math:
        return None
    if isinstance(want, Shard) and want.fused:
        return None
    if isinstance(have, Shard) and have.fused:
        return Unfuse(have.dim, have.widths) if isinstance(want, Replicate) else Via(R)
    return TABLE.get((type(have), type(want), into_sharded_math))


def converted_placement(conversion: Conversion, have: Placement, want: Placement) -> Placement:
    """The placement of the inserted op's output."""
    return want if isinstance(want, Shard) else R


def conversion_dim(conversion: Conversion, have: Placement, want: Placement) -> int | None:
    if conversion.dim_from is None:
        return None
    return (have if conversion.dim_from == "have" else want).dim

