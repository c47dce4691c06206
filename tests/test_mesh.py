"""Mesh: rank <-> coordinates and process-group membership, as pure data (docs/design.md, tests tier 2)."""

from __future__ import annotations

import pytest

from fxpar.ir.mesh import LAYOUT, Axis, Coord, Mesh
from fxpar.plan.plan import Plan

MESHES = [Mesh(dp=8), Mesh(dp=2, tp=4), Mesh(dp=2, pp=2, tp=2), Mesh(pp=3, tp=2), Mesh(),
          Mesh(dp=4, pp=2, ep=2)]


def test_axes_are_outermost_first_with_str_values() -> None:
    assert LAYOUT == (Axis.DP, Axis.PP, Axis.CP, Axis.TP)
    assert [axis.value for axis in Axis] == ["dp", "pp", "cp", "tp", "ep", "edp"]
    assert Axis("tp") is Axis.TP


def test_expert_groups_are_carved_from_the_data_parallel_ranks() -> None:
    """ep neighbours on dp split the experts; the ranks holding the same experts (edp) sum
    their gradients; no rank is added."""
    mesh = Mesh(dp=4, tp=2, ep=2)
    assert mesh.world_size == 8 and mesh.sizes["ep"] == 2 and mesh.sizes["edp"] == 2
    assert mesh.group(5, Axis.DP) == (1, 3, 5, 7)
    assert mesh.group(5, Axis.EP) == (5, 7) and mesh.group(1, Axis.EP) == (1, 3)
    assert mesh.group(5, Axis.EDP) == (1, 5)
    assert mesh.groups(Axis.EP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.coord(5)[Axis.EP] == 0 and mesh.coord(7)[Axis.EP] == 1 and mesh.coord(7)[Axis.EDP] == 1
    assert mesh.coord(5) == Coord(dp=2, pp=0, tp=1)  # the cuts of dp add no coordinate
    assert str(mesh) == "Mesh(dp=4, pp=1, tp=2, ep=2)"
    with pytest.raises(ValueError, match="must divide dp"):
        Mesh(dp=2, ep=4)


def test_context_parallel_ranks_sit_between_pipeline_and_tensor() -> None:
    """rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i: a cp group's ranks are tp apart."""
    mesh = Mesh(dp=2, pp=2, cp=2, tp=2)
    assert mesh.world_size == 16
    assert mesh.coord(13) == Coord(dp=1, pp=1, cp=0, tp=1)  # 13 = ((1 * 2 + 1) * 2 + 0) * 2 + 1
    assert mesh.group(13, Axis.CP) == (13, 15)
    assert mesh.group(13, Axis.TP) == (12, 13)
    assert mesh.group(13, Axis.PP) == (9, 13)
    assert mesh.group(13, Axis.DP) == (5, 13)
    assert all(mesh.rank(mesh.coord(r)) == r for r in range(16))
    assert str(mesh) == "Mesh(dp=2, pp=2, cp=2, tp=2)" and str(Mesh(dp=2)) == "Mesh(dp=2, pp=1, tp=1)"


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_coord_and_rank_round_trip_for_every_rank(mesh: Mesh) -> None:
    coords = [mesh.coord(rank) for rank in range(mesh.world_size)]
    assert len(set(coords)) == mesh.world_size
    for rank, coord in enumerate(coords):
        assert mesh.rank(coord) == rank
        assert mesh.rank_of(dp=coord.dp, pp=coord.pp, tp=coord.tp) == rank


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_rank_follows_the_design_formula(mesh: Mesh) -> None:
    for dp_i in range(mesh.dp):
        for pp_i in range(mesh.pp):
            for tp_i in range(mesh.tp):
                rank = (dp_i * mesh.pp + pp_i) * mesh.tp + tp_i
                assert mesh.rank(Coord(dp=dp_i, pp=pp_i, tp=tp_i)) == rank
                assert mesh.coord(rank) == Coord(dp=dp_i, pp=pp_i, tp=tp_i)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("axis", list(Axis), ids=lambda axis: axis.value)
def test_groups_partition_the_ranks(mesh: Mesh, axis: Axis) -> None:
    groups = mesh.groups(axis)
    assert sorted(rank for group in groups for rank in group) == list(range(mesh.world_size))
    assert len(groups) == mesh.world_size // mesh.size(axis)
    assert [group[0] for group in groups] == sorted(group[0] for group in groups)
    for group in groups:
        assert len(group) == mesh.size(axis) and list(group) == sorted(group)
        coords = [mesh.coord(rank) for rank in group]
        assert [coord[axis] for coord in coords] == list(range(mesh.size(axis)))
        # the coordinates a group shares: every other layout axis, and dp's other cut
        others = {Axis.EP: [Axis.PP, Axis.CP, Axis.TP, Axis.EDP], Axis.EDP: [Axis.PP, Axis.CP, Axis.TP, Axis.EP]
                  }.get(axis, [other for other in LAYOUT if other is not axis])
        assert len({tuple(coord[other] for other in others) for coord in coords}) == 1
        for rank in group:
            assert mesh.group(rank, axis) == group


def test_sizes_and_world_size() -> None:
    mesh = Mesh(dp=2, pp=3, tp=4)
    assert [mesh.size(axis) for axis in LAYOUT] == [2, 3, 1, 4]
    assert mesh.size("pp") == 3  # type: ignore[arg-type]
    assert mesh.world_size == 24
    assert [mesh.stride(axis) for axis in LAYOUT] == [12, 4, 4, 1]
    assert Mesh().world_size == 1


def test_one_axis_mesh_by_hand() -> None:
    mesh = Mesh(dp=8)
    assert mesh.coord(5) == Coord(dp=5, pp=0, tp=0)
    assert mesh.group(5, Axis.DP) == tuple(range(8))
    assert mesh.group(5, Axis.TP) == (5,) and mesh.group(5, Axis.PP) == (5,)
    assert mesh.groups(Axis.DP) == (tuple(range(8)),)
    assert mesh.groups(Axis.TP) == tuple((rank,) for rank in range(8))


def test_two_axis_mesh_by_hand() -> None:
    mesh = Mesh(dp=2, tp=4)
    assert mesh.coord(6) == Coord(dp=1, pp=0, tp=2)
    assert mesh.rank_of(dp=1, tp=3) == 7
    assert mesh.group(6, Axis.TP) == (4, 5, 6, 7)
    assert mesh.group(6, Axis.DP) == (2, 6)
    assert mesh.groups(Axis.TP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert mesh.groups(Axis.DP) == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_three_axis_mesh_by_hand() -> None:
    mesh = Mesh(dp=2, pp=2, tp=2)
    assert mesh.coord(5) == Coord(dp=1, pp=0, tp=1)
    assert mesh.group(5, Axis.TP) == (4, 5)
    assert mesh.group(5, Axis.PP) == (5, 7)
    assert mesh.group(5, Axis.DP) == (1, 5)
    assert mesh.groups(Axis.PP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups(Axis.DP) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh.groups(Axis.TP) == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_1024_ranks_round_trip() -> None:
    mesh = Mesh(dp=8, pp=16, tp=8)
    assert mesh.world_size == 1024
    for rank in range(mesh.world_size):
        assert mesh.rank(mesh.coord(rank)) == rank
    assert mesh.coord(517) == Coord(dp=4, pp=0, tp=5)  # 517 = (4 * 16 + 0) * 8 + 5
    assert mesh.group(517, Axis.PP) == tuple(512 + 5 + 8 * i for i in range(16))
    assert mesh.group(517, Axis.DP) == tuple(5 + 128 * i for i in range(8))
    assert len(mesh.groups(Axis.TP)) == 128 and len(mesh.groups(Axis.DP)) == 128


@pytest.mark.parametrize("rank", [-1, 8, 100, True, 1.0, "1"])
def test_invalid_rank_names_the_valid_range(rank: object) -> None:
    mesh = Mesh(dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match=r"is not on Mesh\(dp=2, pp=2, tp=2\).*0\.\.7"):
        mesh.coord(rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0\.\.7"):
        mesh.group(rank, Axis.TP)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("coord", "shown", "valid"),
    [
        (Coord(dp=2, pp=0, tp=0), "dp=2", "0..1"),
        (Coord(dp=0, pp=0, tp=-1), "tp=-1", "0..3"),
        (Coord(dp=0, pp=1, tp=0), "pp=1", "0..0"),
        (Coord(dp=0, pp=0, tp=True), "tp=True", "0..3"),  # type: ignore[arg-type]
    ],
)
def test_invalid_coord_names_axis_and_range(coord: Coord, shown: str, valid: str) -> None:
    mesh = Mesh(dp=2, tp=4)
    expected = rf"coordinate {shown} is outside Mesh\(dp=2, pp=1, tp=4\).*integer in {valid}\."
    with pytest.raises(ValueError, match=expected):
        mesh.rank(coord)


@pytest.mark.parametrize("sizes", [{"dp": 0}, {"pp": -1}, {"tp": 1.5}, {"dp": True}, {"tp": "2"}])
def test_invalid_sizes_raise(sizes: dict[str, object]) -> None:
    (axis,) = sizes
    with pytest.raises(ValueError, match=f"mesh size along {axis} must be a positive integer"):
        Mesh(**sizes)  # type: ignore[arg-type]


def test_from_plan_reads_the_degrees_and_defaults_missing_ones_to_1() -> None:
    assert Mesh.from_plan(Plan(dp=4, microbatches=2)) == Mesh(dp=4, pp=1, tp=1)

    class LaterPlan:  # a plan with tp and pp, as later versions will have
        dp, pp, tp = 2, 4, 8

    assert Mesh.from_plan(LaterPlan()) == Mesh(dp=2, pp=4, tp=8)  # type: ignore[arg-type]


def test_str_and_describe() -> None:
    mesh = Mesh(dp=2, tp=4)
    assert str(mesh) == "Mesh(dp=2, pp=1, tp=4)"
    lines = mesh.describe().splitlines()
    assert lines[0] == "Mesh(dp=2, pp=1, tp=4)"
    assert lines[1].split() == ["rank", "dp", "pp", "tp"]
    assert [line.split() for line in lines[2:]] == [
        [str(rank), str(rank // 4), "0", str(rank % 4)] for rank in range(8)
    ]
    cut = Mesh(dp=8, pp=16, tp=8).describe(max_ranks=4).splitlines()
    assert len(cut) == 2 + 4 + 1 and "4..1023" in cut[-1]
