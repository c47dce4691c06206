"""Placement rules of views and layout ops: where a sharded dim goes through a reshape,
transpose, slice, split or concatenation (`propagation.RULES` maps the ops to them).

A view keeps a shard when the sharded dim is the outermost of the input dims it regroups
(it is split into, or merged with, the dims after it), and the shard lands on the first of the
output dims; its size constants are then rewritten for the local shard
(`Rewrite.LOCAL_SIZES`). Otherwise the value is gathered first.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import P, Partial, R, Shard
from fxpar.passes.tensor_parallel.decision import Context, Decision, Rewrite, _dim, shape_of
from fxpar.passes.tensor_parallel.projections import slice_bounds

aten = torch.ops.aten


def _groups(in_shape: tuple, out_shape: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input and output dims with equal products: how a reshape regroups dims."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i] if i < len(in_shape) else [], [j] if j < len(out_shape) else []
        pi = in_shape[i] if gi else sympy.Integer(1)
        pj = out_shape[j] if gj else sympy.Integer(1)
        i, j = i + bool(gi), j + bool(gj)
        while sympy.simplify(pi - pj) != 0:
            if (i < len(in_shape)) and (j >= len(out_shape) or _smaller(pi, pj)):
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            elif j < len(out_shape):
                pj *= out_shape[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _smaller(a, b) -> bool:
    """Whether product `a` must grow to reach `b`: b = 4a, or b = seq * a for symbolic sizes
    (and not a = batch * seq against b = batch, where `b` must grow: (B*T, C) -> (B, T, C))."""
    ratio = sympy.simplify(b / a)
    if ratio.is_number:
        return ratio > 1
    _, denominator = sympy.fraction(sympy.together(ratio))
    return denominator.is_number


def view(node: fx.Node, ctx: Context) -> Decision:
    source = node.args[0]
    p = ctx.placement(source)
    if not isinstance(p, Shard):
        return Decision(p, {source: p})
    in_shape, out_shape = shape_of(source), shape_of(node)
    for gi, gj in _groups(in_shape, out_shape):
        if p.dim in gi:
            if gi[0] != p.dim or not gj:  # only the outermost dim of a merge stays contiguous
                return Decision(R, {source: R})
            target = gj[0]
            if p.fused and len(gj) > 1 and len(gi) == 1:
                return Decision(R, {source: R})  # a fused q|k|v viewed before its split
            size = out_shape[target]
            if not size.is_number:
                return Decision(R, {source: R})
            if not p.divides(int(size), ctx.tp):
                raise PlanError(
                    f"{meta.describe(node)} splits a tensor-parallel dim into {int(size)} parts "
                    f"(heads), not divisible by tp={ctx.tp} (for grouped-query attention: the "
                    "number of key/value heads). Fix: choose tp dividing it, or replicate the "
                    "projections (tp_rules)",
                    field="tp",
                    value=ctx.tp,
                )
            return Decision(Shard(target, p.parts), {source: p}, rewrite=Rewrite.LOCAL_SIZES)
    return Decision(R, {source: R})


def expand(node: fx.Node, ctx: Context) -> Decision:
    source, p = node.args[0], ctx.placement(node.args[0])
    if not isinstance(p, Shard):
        return Decision(p, {source: p})
    target = p.dim + len(shape_of(node)) - len(shape_of(source))
    return Decision(Shard(target, p.parts), {source: p}, rewrite=Rewrite.LOCAL_SIZES)


def transpose(node: fx.Node, ctx: Context) -> Decision:
    source, p = node.args[0], ctx.placement(node.args[0])
    if not isinstance(p, Shard):
        return Decision(p, {source: p})
    rank = len(shape_of(source))
    packet = node.target.overloadpacket
    if packet is aten.t:
        order = [1, 0] if rank == 2 else [0]
    elif packet is aten.permute:
        order = [_dim(d, rank) for d in node.args[1]]
    else:
        a, b = _dim(node.args[1], rank), _dim(node.args[2], rank)
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
    return Decision(Shard(order.index(p.dim), p.parts), {source: p})


def unsqueeze(node: fx.Node, ctx: Context) -> Decision:
    source, p = node.args[0], ctx.placement(node.args[0])
    if not isinstance(p, Shard):
        return Decision(p, {source: p})
    d = _dim(node.args[1], len(shape_of(node)))
    return Decision(Shard(p.dim + (d <= p.dim), p.parts), {source: p})


def slicing(node: fx.Node, ctx: Context) -> Decision:
    """slice / select / narrow along a dim: fine unless it is the sharded one."""
    source, p = node.args[0], ctx.placement(node.args[0])
    if not isinstance(p, Shard):
        return Decision(p, {source: p})
    rank = len(shape_of(source))
    d = _dim(node.args[1] if len(node.args) > 1 else 0, rank)
    if d == p.dim and p.fused and one_block(node, p) is not None:
        return Decision(Shard(d), {source: p}, rewrite=Rewrite.LOCAL_SLICE)  # each rank its slice of it
    if d == p.dim:
        return Decision(R, {source: R})
    dropped = node.target.overloadpacket is aten.select and d < p.dim
    return Decision(Shard(p.dim - dropped, p.parts), {source: p})


def one_block(node: fx.Node, placement: Shard) -> tuple[int, int] | None:
    """(start, stop) of the block of a fused dim that a slice of it takes whole (Phi-3's
    qkv[..., :q_width]), else None."""
    width = shape_of(node.args[0])[placement.dim]
    bounds = slice_bounds(node, int(width)) if width.is_number else None
    if bounds is None:
        return None
    _, start, stop = bounds
    blocks = placement.block_sizes(int(width))
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    return (start, stop) if (start, stop) in zip(starts, (a + b for a, b in zip(starts, blocks))) else None


def split(node: fx.Node, ctx: Context) -> Decision:
    source, p = node.args[0], ctx.placement(node.args[0])
    count = len(node.meta["val"])
    if not isinstance(p, Shard):
        return Decision([p] * count, {source: p})
    d = _dim(node.args[2] if len(node.args) > 2 else 0, len(shape_of(source)))
    if d != p.dim:
        return Decision([p] * count, {source: p})
    sizes = [int(v.shape[d]) if isinstance(v.shape[d], int) else None for v in node.meta["val"]]
    width = shape_of(source)[d]
    if p.fused and width.is_number and sizes == p.block_sizes(int(width)):
        # a fused projection's blocks come apart: each rank its own slice of each
        return Decision([Shard(d)] * count, {source: p}, rewrite=Rewrite.LOCAL_SPLIT)
    return Decision([R] * count, {source: R})


def getitem(node: fx.Node, ctx: Context) -> Decision:
    source, index = node.args
    outputs = ctx.placements.get(source)
    return Decision(outputs[index] if isinstance(outputs, list) else R)


def concatenate(node: fx.Node, ctx: Context) -> Decision:
    pieces = [n for n in node.args[0]]
    rank = len(shape_of(node))
    d = _dim(node.args[1] if len(node.args) > 1 else 0, rank)
    placements = {n: ctx.placement(n) for n in pieces}
    first = next(iter(placements.values()))
    if isinstance(first, Shard) and first.dim != d and all(p == first for p in placements.values()):
        return Decision(first, placements)
    return Decision(R, {n: R for n in pieces})


def stack(node: fx.Node, ctx: Context) -> Decision:
    """Tensors alike sharded stack into one sharded the same way, its dim moved past the new
    one when that comes first (GPT-J's rotary: stack((-x2, x1), dim=-1) of head shards)."""
    pieces = list(node.args[0])
    d = _dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape_of(node)))
    placements = {n: ctx.placement(n) for n in pieces}
    first = placements[pieces[0]]
    if isinstance(first, Shard) and all(p == first for p in placements.values()):
        return Decision(Shard(first.dim + (d <= first.dim), first.parts), placements)
    return Decision(R, {n: R for n in pieces})


def repeat_interleave(node: fx.Node, ctx: Context) -> Decision:
    source, p = node.args[0], ctx.placement(node.args[0])
    if isinstance(p, Partial):
        return Decision(P, {source: p})
    return Decision(p, {source: p})  # whole blocks repeat locally, sharded dim included


def complex_view(node: fx.Node, ctx: Context) -> Decision:
    """view_as_complex (the last dim of 2, real and imaginary, becomes one complex value) and
    view_as_real (the reverse), as rotary embeddings written in complex numbers use them
    (Llama 4): a shard of any other dim stays where it is; the pair dim cannot be split."""
    source, p = node.args[0], ctx.placement(node.args[0])
    if not isinstance(p, Shard):
        return Decision(p, {source: p})
    if p.dim == len(shape_of(source)) - 1 and node.target.overloadpacket is aten.view_as_complex:
        return Decision(R, {source: R})  # the (real, imaginary) pair itself split: gather first
    return Decision(p, {source: p})
