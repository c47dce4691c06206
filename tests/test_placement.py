"""Placements: `local_intervals` says where `local_slice`'s piece lies (the checkpoint's chunks)."""

import itertools

import torch

from fxpar.ir.placement import (
    FlatShard, Placements, R, Shard, flat_range, global_tensor, local_intervals, local_shape, local_slice,
)


def _old_local_slice(tensor, placements, coord, sizes):
    """`local_slice` as it was written before `local_intervals`: chunk, then chunk each block."""
    for axis in ("dp", "tp"):
        placement, size = placements[axis], sizes.get(axis, 1)
        if isinstance(placement, Shard) and size > 1:
            blocks = tensor.chunk(placement.parts, dim=placement.dim)
            tensor = torch.cat([b.chunk(size, dim=placement.dim)[coord[axis]] for b in blocks], dim=placement.dim)
    return tensor


def test_intervals_locate_every_element_of_the_piece():
    """For every placement pair (dp and tp on one dim or two, with fused blocks), the piece cut
    by the intervals is the old chunk-based slice, and each interval holds exactly the global
    elements the piece holds there."""
    whole = torch.arange(24 * 12).view(24, 12)
    choices = [R, Shard(0), Shard(1), Shard(0, parts=3), Shard(1, parts=2)]
    checked = 0
    for dp, tp in itertools.product(choices, choices):
        placements, sizes = Placements(dp=dp, tp=tp), {"dp": 2, "tp": 2}
        for coord in ({"dp": a, "tp": b} for a in range(2) for b in range(2)):
            try:
                piece = local_slice(whole, placements, coord, sizes)
            except ValueError as error:  # as the chunking slice refused: blocks that do not split
                assert "does not split" in str(error)
                continue
            checked += 1
            assert torch.equal(piece, _old_local_slice(whole, placements, coord, sizes)), (dp, tp, coord)
            rows, cols = local_intervals(whole.shape, placements, coord, sizes)
            index = [torch.cat([torch.arange(s, s + n) for s, n in r]) for r in (rows, cols)]
            assert torch.equal(piece, whole[index[0][:, None], index[1][None, :]]), (dp, tp, coord)
    assert checked >= 80  # of 100: only fused blocks on an already halved 12 fail to split


def test_a_flat_shard_keeps_its_flat_range_of_the_tp_piece_zero_padded():
    """ZeRO-3's FlatShard on dp after tp's Shard: rank (dp, tp) holds elements `flat_range` of
    its tp piece flattened, padded with zeros to `flat_piece` elements."""
    whole = torch.arange(5 * 6).view(5, 6) + 1
    placements, sizes = Placements(dp=FlatShard(), tp=Shard(1, parts=3)), {"dp": 2, "tp": 2}
    for tp in range(2):
        tp_piece = local_slice(whole, Placements(tp=Shard(1, parts=3)), {"tp": tp}, sizes).flatten()  # 15
        pieces = [local_slice(whole, placements, {"dp": dp, "tp": tp}, sizes) for dp in range(2)]
        assert [tuple(p.shape) for p in pieces] == [(8,), (8,)]
        assert [flat_range(15, placements, {"dp": dp, "tp": tp}, sizes) for dp in range(2)] == [(0, 8), (8, 15)]
        assert torch.equal(torch.cat(pieces), torch.cat([tp_piece, tp_piece.new_zeros(1)]))
    assert flat_range(15, Placements(tp=Shard(0)), {"dp": 0, "tp": 0}, sizes) is None


def test_interval_pieces_put_back_by_global_tensor():
    x = torch.randn(6, 8)
    pieces = [local_slice(x, Placements(tp=Shard(1, parts=2)), {"tp": i}, {"tp": 2}) for i in range(2)]
    assert torch.equal(global_tensor(pieces, Shard(1, parts=2)), x)
    assert local_intervals((6, 8), Placements(tp=Shard(1, parts=2)), {"tp": 1}, {"tp": 2}) == (
        ((0, 6),), ((2, 2), (6, 2)))


def test_unequal_blocks_give_each_rank_its_slice_of_each_and_come_back_whole():
    """Phi-3's grouped-query q|k|v: widths (2, 1, 1), 4 query heads beside 2 key and 2 value
    heads of 2 columns each. Rank r holds the r-th half of each block, side by side; the
    intervals say so, a FlatShard nests in it, and `global_tensor` puts the pieces back."""
    whole = torch.arange(3 * 16).view(3, 16)
    placement = Shard(1, parts=(2, 1, 1))
    assert str(placement) == "S(1, parts=2:1:1)" and placement.block_sizes(16) == [8, 4, 4]
    pieces = [local_slice(whole, Placements(tp=placement), {"tp": r}, {"tp": 2}) for r in range(2)]
    assert pieces[1][0].tolist() == [4, 5, 6, 7, 10, 11, 14, 15]  # q's, k's and v's second halves
    assert local_intervals(whole.shape, Placements(tp=placement), {"tp": 1}, {"tp": 2})[1] == ((4, 4), (10, 2), (14, 2))
    assert torch.equal(global_tensor(pieces, placement), whole)
    nested = Placements(dp=FlatShard(), tp=placement)
    flat = [local_slice(whole, nested, {"dp": d, "tp": 1}, {"dp": 2, "tp": 2}) for d in range(2)]
    assert torch.equal(torch.cat(flat), pieces[1].flatten())
    assert placement.divides(16, 4) and not placement.divides(16, 8)  # k and v blocks of 4
    assert not Shard(1, parts=(2, 1, 1)).divides(12, 2)  # blocks 6, 3, 3: k and v do not halve


def test_a_fused_dim_is_moved_by_viewing_its_blocks_apart_and_nothing_moves_onto_one():
    """The redistribution table's rows for fused dims: to Replicate by `Unfuse` (equal blocks
    viewed apart; unequal ones split, gathered and concatenated), to another Shard via
    Replicate; a fused placement is never a destination (only weights start there)."""
    from fxpar.ops.redistribution import Unfuse, Via, redistribution

    assert redistribution(Shard(2, 2), R, False) == Unfuse(2, (1, 1)) and Unfuse(2, (1, 1)).equal
    assert redistribution(Shard(2, (2, 1, 1)), R, True) == Unfuse(2, (2, 1, 1))
    assert not Unfuse(2, (2, 1, 1)).equal
    assert redistribution(Shard(2, (2, 1, 1)), Shard(1), False) == Via(R)
    assert redistribution(R, Shard(0, 2), False) is None
    assert redistribution(Shard(2, 3), Shard(2, 3), False) is None  # already there


def test_a_buckets_shards_are_flat_shard_pieces():
    """ZeRO's bucket shards (`Bucket.shard`, what the sharded optimizer steps) and a FlatShard
    value's piece (`placement.local_shape`, what ZeRO-3 holds and the estimate counts) are one
    size, rounded up the same way, at every size and degree."""
    from fxpar.ir.buckets import Bucket

    for numel, ranks in itertools.product((1, 7, 8, 1000, 1001), (1, 2, 3, 8)):
        bucket = Bucket(index=0, parameters=("w",), numel=numel, dtype=torch.float32)
        piece = local_shape((numel,), Placements(dp=FlatShard()), {"dp": ranks})
        shards = [bucket.shard(ranks, i) for i in range(ranks)]
        assert [(s.start, s.stop - s.start) for s in shards] == [(i * piece[0], piece[0]) for i in range(ranks)]
        assert bucket.padded(ranks) == piece[0] * ranks
