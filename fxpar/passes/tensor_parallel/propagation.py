"""Placement propagation: one rule per aten op, deciding where its inputs must lie.

A rule sees the node and the placements of its tensor inputs, and returns a `Decision`: the
placement every tensor input must have (the pass inserts the collective that gets it there,
from `fxpar.ops.redistribution`) and the placement of the output, plus an optional rewrite
of the node itself (local constants in a view, a vocabulary-parallel kernel). Adding an op is
adding a line to `RULES`.

An op without a rule is fine while all its inputs are replicated (every rank computes it
whole); with a sharded or partial input it is a PlanError that names the node, its module path,
the op, the input placements and the modules that split them, which the user can keep whole.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import P, Partial, R, Replicate, Shard
from fxpar.ops.expert_routing import is_grouped_mm
from fxpar.passes.tensor_parallel.decision import (
    Context, Decision, Rewrite, _dim, _resolve_partials, shape_of, tensor_inputs,
)
from fxpar.passes.tensor_parallel.projections import projection_of
from fxpar.passes.tensor_parallel.view_rules import (
    complex_view, concatenate, expand, getitem, repeat_interleave, slicing, split, stack, transpose,
    unsqueeze, view,
)

aten = torch.ops.aten


# -- elementwise ops with broadcasting -------------------------------------------------------

_LINEAR_IN_PARTIALS = {aten.add, aten.sub}  # P op P = P
# Elementwise ops that start a norm or are dropout: under sequence parallelism they move the
# replicated residual stream onto sequence shards (RMSNorm begins with x.pow(2)).
_ON_SEQUENCE_SHARDS = {aten.dropout, aten.pow, aten.square, aten.mul, aten.to, aten._to_copy}
_SCALES_A_PARTIAL = {aten.mul, aten.div, aten.neg, aten._to_copy, aten.clone, aten.alias,
                     aten.contiguous, aten.type_as, aten.to, aten.detach}  # P op R = P


def elementwise(node: fx.Node, ctx: Context) -> Decision:
    out_shape = shape_of(node)
    rank = len(out_shape)
    inputs = {n: ctx.placement(n) for n in tensor_inputs(node)}
    packet = node.target.overloadpacket
    partials = [n for n, p in inputs.items() if isinstance(p, Partial)]
    if partials:
        others = [p for n, p in inputs.items() if n not in partials]
        if packet in _LINEAR_IN_PARTIALS and not others:
            return Decision(P, dict(inputs))
        divisor = packet is aten.div and node.args[0] is not partials[0]
        if packet in _SCALES_A_PARTIAL and len(partials) == 1 and not divisor and all(
            isinstance(p, Replicate) for p in others
        ):
            return Decision(P, dict(inputs))
        inputs = _resolve_partials(node, ctx, inputs)
    if (stream := ctx.sequence_shard(node, inputs)) is not None and packet in _ON_SEQUENCE_SHARDS:
        inputs[stream] = Shard(1)
    out_dim, parts = None, 1
    for n, p in inputs.items():
        if isinstance(p, Shard):
            out_dim, parts = p.dim + rank - len(shape_of(n)), p.parts
            break
    if out_dim is None:
        return Decision(R, inputs)
    wanted = {}
    for n, p in inputs.items():
        shape = shape_of(n)
        local_dim = out_dim - (rank - len(shape))
        broadcast = local_dim < 0 or shape[local_dim] == 1 and out_shape[out_dim] != 1
        wanted[n] = R if broadcast else Shard(local_dim, parts)
    return Decision(Shard(out_dim, parts), wanted)


# -- reductions and normalisations -----------------------------------------------------------


def _reduced_dims(node: fx.Node, rank: int) -> tuple[set[int], bool]:
    packet = node.target.overloadpacket
    if packet in (aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax):
        return {_dim(node.args[1], rank)}, True
    if packet is aten.layer_norm:
        return set(range(rank - len(node.args[1]), rank)), True
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = range(rank) if dims is None else ([dims] if isinstance(dims, int) else dims)
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return {_dim(d, rank) for d in dims}, keepdim


def reduction(node: fx.Node, ctx: Context) -> Decision:
    source = node.args[0]
    inputs = _resolve_partials(node, ctx, {n: ctx.placement(n) for n in tensor_inputs(node)})
    if node.target.overloadpacket is aten.layer_norm and ctx.sequence_shard(node, {source: inputs[source]}) is source:
        inputs[source] = Shard(1)
    p, rank = inputs[source], len(shape_of(source))
    reduced, keepdim = _reduced_dims(node, rank)
    if not isinstance(p, Shard):
        return Decision(R, {n: R for n in inputs})
    if p.dim in reduced:
        return Decision(R, {n: R for n in inputs})
    out_dim = p.dim if keepdim else p.dim - sum(d < p.dim for d in reduced)
    wanted = {n: (p if n is source else R) for n in inputs}  # norm weights stay replicated
    return Decision(Shard(out_dim, p.parts), wanted)


# -- contractions ----------------------------------------------------------------------------


def projection(node: fx.Node, ctx: Context) -> Decision:
    """x @ W (+ b) in any form of `projections` (linear, addmm, mm, matmul with a weight).

    Column-parallel (W split on its output dim): the input whole, the output split on its
    last dim like W, the bias split with it. Row-parallel (W split on its input dim): the
    input split on its last dim, partial sums out, the bias added once after the sum
    (rewrite `bias_after_reduction`). A replicated W keeps a batch or sequence shard of x, and
    a bias-free one carries a partial sum through (the product is linear in x).
    """
    proj = projection_of(node)
    if proj is None:  # mm or matmul of two activations; addmm without a weight
        return matmul(node, ctx) if node.target.overloadpacket is not aten.addmm else _replicated(node)
    x, weight, bias = proj.x, proj.weight, proj.bias
    wp, xp = ctx.placement(weight), ctx.placement(x)
    rank, out_rank = len(shape_of(x)), len(shape_of(node))
    if isinstance(wp, Shard) and wp.dim == proj.out_dim:  # column-parallel
        inputs = {x: R, weight: wp}
        if bias is not None:
            inputs[bias] = Shard(len(shape_of(bias)) - 1, wp.parts)
        return Decision(Shard(out_rank - 1, wp.parts), inputs)
    if isinstance(wp, Shard) and wp.dim == proj.in_dim:  # row-parallel: partial sums
        inputs = {x: Shard(rank - 1, wp.parts), weight: wp}
        return Decision(P, inputs, rewrite=Rewrite.BIAS_AFTER_REDUCTION if bias is not None else None)
    if isinstance(xp, Shard) and xp.dim < rank - 1:  # a replicated weight on a batch/seq shard
        return Decision(xp, {x: xp, weight: R} | ({bias: R} if bias is not None else {}))
    if isinstance(xp, Partial) and bias is None:
        return Decision(P, {x: P, weight: R})
    return _replicated(node)


def grouped_projection(node: fx.Node, ctx: Context) -> Decision:
    """A mixture of experts' grouped matmul, `rows @ W[expert]` (`projections.GroupedProjection`),
    as a projection: weights split on their output dim (the operand's last) make a
    column-parallel output from whole rows; split on their input dim they take rows split on
    their last dim and make partial sums. The offsets (each expert's rows) are whole."""
    rows, weights = node.args[0], node.args[1]
    wp = ctx.placement(weights)
    others = {n: R for n in tensor_inputs(node) if n not in (rows, weights)}
    if isinstance(wp, Shard) and wp.dim == 2:
        return Decision(Shard(1, wp.parts), {rows: R, weights: wp, **others})
    if isinstance(wp, Shard) and wp.dim == 1:
        return Decision(P, {rows: Shard(1, wp.parts), weights: wp, **others})
    return _replicated(node)


def row_index(node: fx.Node, ctx: Context) -> Decision:
    """`x[i]`, rows picked by one whole index tensor (a mixture of experts puts its rows in
    order so): the picked rows of a partial sum are a partial sum, and a split of the dims
    after the picked one stays, behind the index's dims."""
    source, indices = node.args[0], node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return _replicated(node)
    placement, (index,) = ctx.placement(source), indices
    if isinstance(placement, Partial):
        return Decision(P, {source: P, index: R})
    if isinstance(placement, Shard) and placement.dim >= 1:
        return Decision(Shard(placement.dim - 1 + len(shape_of(index)), placement.parts), {source: placement, index: R})
    return _replicated(node)


def _replicated(node: fx.Node) -> Decision:
    return Decision(R, {n: R for n in tensor_inputs(node)})


def attention(node: fx.Node, ctx: Context) -> Decision:
    q = node.args[0]
    inputs = _resolve_partials(node, ctx, {n: ctx.placement(n) for n in tensor_inputs(node)})
    rank = len(shape_of(q))
    shard = next((p for p in inputs.values() if isinstance(p, Shard) and p.dim < rank - 2), None)
    if shard is None:
        return Decision(R, {n: R for n in inputs})
    wanted = {}
    for n in inputs:
        shape = shape_of(n)
        local = shard.dim - (rank - len(shape))
        wanted[n] = R if local < 0 or shape[local] == 1 else Shard(local)
    return Decision(Shard(shard.dim), wanted)


def matmul(node: fx.Node, ctx: Context) -> Decision:
    a, b = node.args[0], node.args[1]
    inputs = _resolve_partials(node, ctx, {a: ctx.placement(a), b: ctx.placement(b)})
    pa, pb = inputs[a], inputs[b]
    ra, rb, rank = len(shape_of(a)), len(shape_of(b)), len(shape_of(node))
    if isinstance(pa, Shard) and isinstance(pb, Shard) and pa.dim == ra - 1 and pb.dim == rb - 2:
        return Decision(P, inputs)  # the contracted dim is sharded: partial sums
    for p, r in ((pa, ra), (pb, rb)):
        if isinstance(p, Shard) and p.dim < r - 2:  # a batch dim: both sides shard it
            d = p.dim + rank - r
            return Decision(Shard(d), {a: Shard(d - rank + ra), b: Shard(d - rank + rb)})
    if isinstance(pa, Shard) and pa.dim == ra - 2 and isinstance(pb, Replicate):
        return Decision(Shard(rank - 2), inputs)
    if isinstance(pb, Shard) and pb.dim == rb - 1 and isinstance(pa, Replicate):
        return Decision(Shard(rank - 1), inputs)
    return Decision(R, {a: R, b: R})


# -- vocabulary-parallel embedding and loss --------------------------------------------------


def embedding(node: fx.Node, ctx: Context) -> Decision:
    """A vocabulary-sharded table gives partial sums (each rank its rows' lookups), summed right
    where they are produced, as Megatron's VocabParallelEmbedding does: carried on, the partial
    would ride the residual stream and every norm would sum it again. Under sequence
    parallelism the sum is a reduce-scatter onto sequence shards (`ctx.partial_target`)."""
    weight, indices = node.args[0], node.args[1]
    wp, ip = ctx.placement(weight), ctx.placement(indices)
    if isinstance(wp, Shard) and wp.dim == 0:
        return Decision(P, {weight: wp, indices: R}, rewrite=Rewrite.VOCAB_PARALLEL_EMBEDDING,
                        settle_to=ctx.partial_target(node))
    if isinstance(wp, Shard) and wp.dim == 1:
        return Decision(Shard(len(shape_of(node)) - 1), {weight: wp, indices: R})
    return Decision(ip if isinstance(ip, Shard) else R, {weight: R, indices: ip if isinstance(ip, Shard) else R})


def cross_entropy(node: fx.Node, ctx: Context) -> Decision:
    logits, target = node.args[0], node.args[1]
    p = ctx.placement(logits)
    if isinstance(p, Shard) and p.dim == len(shape_of(logits)) - 1 and len(shape_of(logits)) == 2:
        return Decision(R, {logits: p, target: R}, rewrite=Rewrite.VOCAB_PARALLEL_CROSS_ENTROPY)
    return Decision(R, {n: R for n in tensor_inputs(node)})


_IN_PLACE = [aten.add_, aten.sub_, aten.mul_, aten.div_]


def in_place(node: fx.Node, ctx: Context) -> Decision:
    """`x.add_(y)` and the like, as their out-of-place op: where a collective must make `x`
    whole first (Llama 4 adds its routed experts into the shared expert's partial output), the
    op writes into the collective's result instead of `x`, the same value only if nothing else
    reads `x`: export sends later reads through the op's output, but a view taken before it
    (an alias of `x`) would miss the write. So a split `x` with another reader is a PlanError."""
    written = node.args[0]
    others = [user for user in written.users if user is not node]
    if others and not isinstance(ctx.placement(written), Replicate):
        module = meta.module_path(written)
        raise PlanError(
            f"tensor parallelism cannot write in place into the split value {written.name} at "
            f"{meta.describe(node)}: {others[0].format_node()} also reads it, and would not see "
            f"the write. Fix: keep module {module or '<root module>'!r} whole (tp_rules={{"
            f"{module!r}: 'replicate'}}, with the rest of your rules), or write `x = x + y`",
            field="tp_rules",
        )
    return elementwise(node, ctx)


def creation(node: fx.Node, ctx: Context) -> Decision:
    return Decision(R, {n: R for n in tensor_inputs(node)})


def passthrough(node: fx.Node, ctx: Context) -> Decision:
    source = node.args[0]
    p = ctx.placement(source)
    return Decision(p, {source: p})


_ELEMENTWISE = [
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.rsqrt, aten.sqrt,
    aten.exp, aten.log, aten.gelu, aten.silu, aten.relu, aten.tanh, aten.sigmoid, aten.where,
    aten.masked_fill, aten.dropout, aten.reciprocal, aten.maximum, aten.minimum, aten.clamp,
    aten.cos, aten.sin, aten.abs, aten.square, aten.erf, aten.eq, aten.ne, aten.lt, aten.gt,
    aten.le, aten.ge, aten.logical_not, aten.logical_and, aten.bitwise_not, aten._to_copy,
    aten.to, aten.type_as, aten.clone, aten.contiguous, aten.alias, aten.detach,
]
RULES: dict[object, Callable[[fx.Node, Context], Decision]] = {
    **{op: elementwise for op in _ELEMENTWISE},
    **{op: in_place for op in _IN_PLACE},
    aten.view_as_complex: complex_view, aten.view_as_real: complex_view,
    aten.view: view, aten._unsafe_view: view, aten.reshape: view, aten.expand: expand,
    aten.flatten: view, aten.unflatten: view, aten.squeeze: view,
    aten.transpose: transpose, aten.permute: transpose, aten.t: transpose,
    aten.unsqueeze: unsqueeze,
    aten.slice: slicing, aten.select: slicing, aten.narrow: slicing,
    aten.split: split, aten.split_with_sizes: split, aten.chunk: split, aten.unbind: split,
    operator.getitem: getitem,
    aten.cat: concatenate, aten.stack: stack, aten.repeat_interleave: repeat_interleave,
    aten.layer_norm: reduction, aten.softmax: reduction, aten._softmax: reduction,
    aten.log_softmax: reduction, aten._log_softmax: reduction, aten.mean: reduction,
    aten.sum: reduction, aten.amax: reduction,
    aten.index: row_index,
    aten.linear: projection, aten.addmm: projection, aten.mm: projection,
    aten.matmul: projection, aten.bmm: matmul,
    aten.scaled_dot_product_attention: attention,
    aten.embedding: embedding, aten.cross_entropy_loss: cross_entropy,
    aten.arange: creation, aten.zeros: creation, aten.ones: creation, aten.full: creation,
    aten.empty: creation, aten.scalar_tensor: creation, aten.zeros_like: passthrough,
    aten.ones_like: passthrough, aten.full_like: passthrough, aten.empty_like: passthrough,
    aten.tril: passthrough, aten.triu: passthrough,
}


def rule_for(node: fx.Node) -> Callable[[fx.Node, Context], Decision] | None:
    if is_grouped_mm(node):  # (an op of transformers' library, registered when it loads)
        return grouped_projection
    target = node.target
    key = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    return RULES.get(key)
