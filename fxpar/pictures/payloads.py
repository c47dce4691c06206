"""What a collective moves, as a formula and as bytes, and where a value lies on each mesh axis.

The pictures (`fxpar.pictures.picture`), the report and the plan diff label collectives the same way:

    payload_formula(captured, shape, placements, sizes=mesh.sizes, microbatches=2)   8*batch*seq
    payload_text(formula, numel=1024, dtype=torch.float32)        "8*batch*seq x f32 = 4.1 kB"

`shape` is a value's global shape (export's symbols or ints) and `placements` its placement
on each mesh axis (`fxpar.ir.meta.placements`); a rank's piece of it at one microbatch is what
`placement.local_shape` gives (the batch split over dp, a tp shard's dim over tp), so at the
example's sizes the formula is the `numel` `program.collectives(r)` reports. Formulas are in
the readable symbols `batch` (the global batch) and `seq` (`fxpar.ir.symbols`).
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
import torch.fx as fx

from fxpar.frontend.trace import CapturedGraph
from fxpar.ir import meta
from fxpar.ir.mesh import LAYOUT, Axis, Mesh
from fxpar.ir.placement import Placements, Sizes, local_numel
from fxpar.ir.symbols import BATCH

_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.int64: "i64", torch.int32: "i32", torch.float64: "f64", torch.bool: "bool"}
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def payload_formula(
    captured: CapturedGraph, shape: Sequence[object], placements: Placements, *, sizes: Sizes, microbatches: int
) -> sympy.Expr:
    """Elements of one rank's piece of a value of global `shape`, in `batch` and `seq`, at
    one of the step's `microbatches` (`placement.local_numel` divides each sharded dim, the
    batch over dp among them)."""
    dims = [captured.readable(d).subs(BATCH, BATCH / microbatches) for d in shape]
    return sympy.expand(sympy.sympify(local_numel(dims, placements, sizes)))


def example_numel(captured: CapturedGraph, formula: sympy.Expr) -> int:
    """The formula's value at the example inputs' sizes."""
    return int(sympy.sympify(formula).subs(captured.example_sizes))


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def format_bytes(count: float) -> str:
    """`4096 -> "4.1 kB"`: decimal prefixes, as the estimate's tables print them."""
    for scale, prefix in _PREFIXES:
        if abs(count) >= scale:
            return f"{count / scale:.1f} {prefix}B"
    return f"{count:.0f} B"


def payload_text(formula: sympy.Expr | int, *, numel: int, dtype: torch.dtype) -> str:
    """`"8*batch*seq x f32 = 4.1 kB"`: elements as a formula (or a number), their dtype, and
    the bytes at the example's sizes (`numel` elements)."""
    shown = f"{formula:,}" if isinstance(formula, int) else str(formula)
    return f"{shown} x {dtype_name(dtype)} = {format_bytes(numel * dtype.itemsize)}"


def axis_name(mesh: Mesh, rank: int, group: Sequence[int]) -> str:
    """The mesh axis (or axes, "dp+pp") along which a group's ranks differ: "tp" for rank 0's
    tensor-parallel group, "pp" for a send between two stages, "-" for a group of one."""
    for axis in Axis:
        if tuple(group) == mesh.group(rank, axis) and mesh.size(axis) > 1:
            return axis.value
    coords = [mesh.coord(r) for r in group]
    varying = [a.value for a in LAYOUT if len({c[a] for c in coords}) > 1]
    return "+".join(varying) or "-"


def placement_text(node: fx.Node, mesh: Mesh) -> str:
    """Where a value lies on each data-splitting mesh axis of size > 1 (`fxpar.ir.meta.placements`),
    e.g. "tp S(2) · dp S(0)"; the pipeline axis is the stage, drawn as a cluster."""
    value = meta.placements(node)
    if not isinstance(value, Placements):  # a tuple-valued op: one per output
        return ""
    return " · ".join(f"{axis} {value[axis]}" for axis in ("tp", "dp") if mesh.sizes.get(axis, 1) > 1)


def shape_text(captured: CapturedGraph, shape: Sequence[object]) -> str:
    """`(batch, seq, 32)`: a global shape in readable symbols."""
    return "(" + ", ".join(str(captured.readable(d)) for d in shape) + ")"
