"""What a collective moves, as a formula and as bytes, and where a value lies on each mesh axis.

The pictures (`fxpar.picture`), the report and the plan diff label collectives the same way:

    payload_formula(captured, shape, placement, tp=2, pieces=4)    8*batch*seq
    payload_text(formula, numel=1024, dtype=torch.float32)         "8*batch*seq x f32 = 4.1 kB"

`shape` is a value's global shape (export's symbols or ints); a rank's piece of it divides the
batch over `pieces = dp x microbatches` (each rank runs one microbatch of its replica's share at
a time) and a `Shard` dim over the tp group, exactly as `placement.local_shape` does for the
numbers: so at the example's sizes the formula is the `numel` `program.collectives(r)` reports.
Formulas are in the readable symbols `batch` (the global batch) and `seq` (`fxpar.symbols`).
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
import torch.fx as fx

from fxpar import meta
from fxpar.mesh import Axis, Mesh
from fxpar.placement import Placement, Shard
from fxpar.symbols import BATCH
from fxpar.trace import CapturedGraph

_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.int64: "i64", torch.int32: "i32", torch.float64: "f64", torch.bool: "bool"}
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def payload_formula(
    captured: CapturedGraph, shape: Sequence[object], placement: Placement, *, tp: int, pieces: int
) -> sympy.Expr:
    """Elements of one rank's piece of a value of global `shape`, in `batch` and `seq`."""
    dims = [captured.readable(d).subs(BATCH, BATCH / pieces) for d in shape]
    if isinstance(placement, Shard) and tp > 1:
        dims[placement.dim] = dims[placement.dim] / tp
    return sympy.expand(sympy.Mul(*dims))


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
    varying = [a.value for a in Axis if len({c[a] for c in coords}) > 1]
    return "+".join(varying) or "-"


def placement_text(captured: CapturedGraph, node: fx.Node, mesh: Mesh) -> str:
    """Where a value lies on each mesh axis of size > 1, e.g. "tp S(2) · dp S(0)".

    tp: the node's `fxpar.placement`. dp: each replica holds its share of the batch, so a value
    with a batch dim is `S(that dim)` on dp; the rest (parameters, counts) is replicated there
    and not shown. The pipeline axis is the stage, drawn as a cluster.
    """
    parts = []
    if mesh.tp > 1:
        placement = meta.placement(node)
        shown = "/".join(map(str, placement)) if isinstance(placement, (list, tuple)) else str(placement)
        parts.append(f"tp {shown}")
    if mesh.dp > 1:
        dim = batch_dim(captured, node)
        if dim is not None:
            parts.append(f"dp S({dim})")
    return " · ".join(parts)


def batch_dim(captured: CapturedGraph, node: fx.Node) -> int | None:
    """The first dim of a tensor value whose size depends on the batch, else None."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    for dim, size in enumerate(value.shape):
        if captured.readable(size).has(BATCH):
            return dim
    return None


def shape_text(captured: CapturedGraph, shape: Sequence[object]) -> str:
    """`(batch, seq, 32)`: a global shape in readable symbols."""
    return "(" + ", ".join(str(captured.readable(d)) for d in shape) + ")"
