"""The redistribution table: how a value moves from one placement on a mesh axis to another.

A pass that finds a value laid out otherwise than its consumer needs asks `redistribution`
for the op to insert; the op's backward is the dual conversion (`fxpar.distributed_ops`). A
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

A fused dim (`Shard(d, parts)` with parts > 1) has no row: its pieces are not contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.distributed_ops import BY_NAME, DistributedOp
from fxpar.placement import Partial, Placement, R, Replicate, Shard


@dataclass(frozen=True)
class Conversion:
    """Insert `op` (on the source's Shard dim, or the destination's, when it takes one)."""

    op: DistributedOp
    dim_from: str | None = None  # "have" or "want": whose Shard dim the op works on


@dataclass(frozen=True)
class Via:
    """Convert to `placement` first, then on from there."""

    placement: Placement


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


def redistribution(have: Placement, want: Placement, into_sharded_math: bool) -> Conversion | Via | None:
    """The table's row for this move, or None when there is none (the caller says why)."""
    fused = any(isinstance(p, Shard) and p.parts != 1 for p in (have, want))
    if fused or (have == want and not into_sharded_math):
        return None
    return TABLE.get((type(have), type(want), into_sharded_math))


def converted_placement(conversion: Conversion, have: Placement, want: Placement) -> Placement:
    """The placement of the inserted op's output."""
    return want if isinstance(want, Shard) else R


def conversion_dim(conversion: Conversion, have: Placement, want: Placement) -> int | None:
    if conversion.dim_from is None:
        return None
    return (have if conversion.dim_from == "have" else want).dim

