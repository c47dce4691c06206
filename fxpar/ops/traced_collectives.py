"""The distributed ops in the form a compiled graph traces through.

A registered op (`ops.distributed`) is opaque to Dynamo: its forward runs as one call, waited
for where it starts, and since a custom op may not return its input, f's identity forward copies
its input and g's identity backward copies the gradient. A rank module compiled by Inductor
calls `TracedOp.apply` instead, an autograd function Dynamo traces into the graph, built from
the same `DistributedOp`: an identity is no op (a view), a slice a view of this rank's piece,
and a collective its start and its wait (`collective_primitives.started`), in forward and
backward alike, which `runtime.collective_schedule` places. The binding issues the same calls
in the same order, so the step program, its guard and `comm_stats()` read them as before.

    compile form:  copy_to_region = fxpar.ops.traced_collectives.copy_to_region(layer_norm, 'tp')

`compiled_form` is a rank module as Inductor gets it (these ops, and ZeRO-3's re-gathers as
recomputation, `ops.recomputed_gathers`): the runtime compiles it and the estimate partitions it
(`cost.compiled_activations`), so both see one graph.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from fxpar.ir.axes import bound
from fxpar.ops.collective_primitives import Primitive, recomputable, started
from fxpar.ops.distributed import BY_NAME, OPS, DistributedOp, distributed_op
from fxpar.ops.parameter_gathers import OP as GATHER_OP, REGATHER, laid_out, laid_out_gradients, whole_values
from fxpar.ops.recomputed_gathers import GATHER, regathered_by_recomputation


def _primitive(primitive: Primitive, x: torch.Tensor, axis: str, size: int, dim: int, reduce: str, tag: str,
               phase: str) -> torch.Tensor:
    if primitive == "identity":
        return x.view_as(x)
    if primitive == "slice":
        width = x.shape[dim] // size
        return x.narrow(dim, bound(axis).index * width, width)
    return started(primitive, x, axis, size, dim, tag, phase, reduce)


class TracedOp(torch.autograd.Function):
    """One DistributedOp (by name) with its two primitives as traceable code (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str, axis: str, size: int, dim: int) -> torch.Tensor:
        ctx.name, ctx.axis, ctx.size, ctx.dim = name, axis, size, dim
        op = BY_NAME[name]
        return _primitive(op.forward, x, axis, size, dim, op.reduce, op.tag(axis, "forward"), "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        op = BY_NAME[ctx.name]
        if op.backward is None:
            return None, None, None, None, None
        grad = _primitive(op.backward, grad, ctx.axis, ctx.size, ctx.dim, "sum", op.tag(ctx.axis, "backward"),
                          "backward")
        return grad, None, None, None, None


def _traced_function(op: DistributedOp):
    def call(x, axis, size=1, dim=0):
        return TracedOp.apply(x, op.name, axis, size, dim)

    call.__name__ = call.__qualname__ = op.name
    call.__module__ = __name__
    return call


class TracedGather(torch.autograd.Function):
    """ZeRO-3's `gather_parameters` (`ops.parameter_gathers`) as traceable code: the layer's
    shards laid out and all-gathered, each parameter's whole value cut out; backward, the
    gradients laid out and reduce-scattered, each shard's piece cut out. Started and waited for
    as two ops each way, so that `runtime.collective_schedule` can gather a layer while the
    layer before it computes (FSDP's prefetch) and reduce-scatter under the backward's next
    ops. A recomputation in backward (`ops.recomputed_gathers`) is the step program's
    re-gather: the start op tells the two apart at run time (`collective_primitives`)."""

    @staticmethod
    def forward(ctx, axis: str, size: int, dtype, *shards: torch.Tensor):
        ctx.axis, ctx.size = axis, size
        ctx.widths, ctx.shapes = [s.numel() for s in shards], [s.shape for s in shards]
        ctx.dtype = shards[0].dtype  # the gradients are summed in the pieces' dtype
        tags = recomputable(GATHER_OP.tag(axis, "forward"), REGATHER.tag(axis, "backward"))
        gathered = started("all_gather", laid_out(list(shards), dtype), axis, size, 0, tags, "forward")
        return tuple(whole_values(gathered, ctx.widths, size))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        like = next(g for g in grads if g is not None)
        stacked = laid_out_gradients(list(grads), ctx.widths, like, ctx.size, ctx.dtype)
        flat = started("reduce_scatter", stacked.reshape(-1), ctx.axis, ctx.size, 0,
                       GATHER_OP.tag(ctx.axis, "backward"), "backward")
        pieces = [p.view(shape) for p, shape in zip(flat.split(ctx.widths), ctx.shapes)]
        return (None, None, None, *pieces)


def gather_parameters(shards, axis, size, *, dtype=None):
    return list(TracedGather.apply(axis, size, dtype, *shards))


TRACED = {op.overload: _traced_function(op) for op in OPS if op.standard}
TRACED[GATHER] = gather_parameters


def lower_for_compile(module: fx.GraphModule) -> fx.GraphModule:
    """`module` with each distributed op in its traced form: a new GraphModule over the same
    parameters (the program's own keeps the registered ops, which lowering and the cost model
    read); `module` itself when it has none."""
    if not any(distributed_op(n) is not None and n.target in TRACED for n in module.graph.nodes):
        return module
    graph = copy.deepcopy(module.graph)  # nodes copied, meta shallow
    for node in graph.nodes:
        if node.op == "call_function" and node.target in TRACED:
            node.target = TRACED[node.target]
    lowered = fx.GraphModule(module, graph, class_name=type(module).__name__)
    lowered.meta.update(module.meta)
    return lowered


def compiled_form(module: fx.GraphModule) -> fx.GraphModule:
    """`module` as the runtime hands it to Inductor (module doc)."""
    return lower_for_compile(regathered_by_recomputation(module))
