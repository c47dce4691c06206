"""ZeRO-3: every trained parameter sharded over dp, each layer's gathered before its first use.

ZeRO stage 3 (Rajbhandari et al. 2020, Sec. 5.3; PyTorch's FSDP) partitions the parameters
themselves: each of the N data-parallel ranks stores 1/N of every trained parameter, so
model state costs 16P/N bytes with Adam in fp32. This pass expresses it in the IR: a
parameter's placement on the dp axis becomes `FlatShard` (its tensor-parallel piece,
flattened and padded, cut in N; `placement.local_slice` cuts it at rank specialisation), and
before the first use of each layer's parameters one `fxpar.gather_parameters` op
(`fxpar.ops.parameter_gathers`) gathers them all, in one all-gather; its backward is one
reduce-scatter of their gradients. The layer's uses then read the gathered values:

    before: %w : get_attr[target=h.0.attn.q.weight]                         dp=R
            %linear = aten.linear(%x, %w, %b)
    after:  %w : get_attr[target=h.0.attn.q.weight]                         dp=F
            %gathered = fxpar.gather_parameters([%w, %b, ...], 'dp', 2)
            %w_whole = aten.view(aten.narrow(gathered[0], 0, 0, n), shape)   dp=R
            %linear = aten.linear(%x, %w_whole, %b_whole)

With `reshard_after_forward`, the layer's output goes through
`fxpar.regather_parameters(x, [pieces...], 'dp', N)`: an identity whose backward, the first of
the layer's in backward, gathers the layer again (FSDP's reshard after forward). Not the root's
unit: it holds the head, whose backward is the first of the step, right after its forward, so
its whole weights are kept for backward instead of gathered again at once (FSDP2's default,
`reshard_after_forward=None`, which reshards every module but the root). The layer's
output is the last node of the layer's module path that follows from its last use of its
gathered values (a block's residual add), else that use itself (the root's head): so a
block's activation checkpoint region (`runtime.step.recompute`, which ZeRO-3's ops end) is the
whole block, recomputed from the weights the regather's backward gathered.

A layer (an FSDP unit) is a block of the model's repeated block list: the parameters whose
names share the path up to their first numeric part (`h.3.attn.q.weight` -> `h.3`); the
others (embeddings, final norm, head) form one unit of the root, as FSDP wraps the root. A
unit holds one dtype (a mixed-dtype layer makes one unit per dtype).

Under bf16-mixed (`passes.mixed_precision`: parameters computed in bf16, trained in fp32),
`reduce_dtype` decides what a piece is. With fp32 (the default, FSDP2's way: sharded
parameters fp32, `param_dtype` bf16) the pieces are the fp32 master values themselves, and
the gather casts them to bf16 as it lays them out (`gather_parameters(..., dtype=bf16)`): the
all-gather moves bf16, the layer computes in bf16, and the reduce-scatter sums the gradients
in fp32 (the pieces' dtype) into fp32 piece gradients the optimizer steps the pieces with, no
rounding through bf16 on the way. A rank holds 4P/N of fp32 pieces, 4P/N of fp32 gradients
and the optimizer's fp32 state (Adam 8P/N): 16P/N, the ZeRO paper's mixed-precision total;
bf16 whole weights exist only while a layer runs. With bf16 the pieces are bf16 working
copies with per-piece fp32 masters (`runtime.state.master_weights`), and gather and reduce-scatter
both run in bf16: 2P/N + 2P/N + 12P/N.

A gradient summed at the step's end (a parameter tied across pipeline ranks; under sp, a
replicated norm's partial tp gradient) is summed on the pieces: the sum commutes with the
dp reduce-scatter, and every copy of the parameter has the same pieces.

Requires: the placements of every parameter on the tp axis (the tp pass), gradient buckets
(`meta.trained_parameters`: which parameters are trained).
Ensures: every trained parameter is FlatShard on dp, read only by its unit's gather (and
regather); each gather comes before every use of its outputs; under bf16-mixed with fp32
reduction the pieces are fp32 with no `fxpar.master_dtype` and their gathers name bf16; with
`reshard_after_forward` each unit but the root's has one regather, after every use;
`gm.meta[GRAPH_PARAMETER_UNITS]` lists the units in gather order.
"""

from __future__ import annotations

import math
import operator
import re

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.mesh import Mesh
from fxpar.ir.parameter_units import ParameterUnit
from fxpar.ir.placement import FlatShard, R, local_shape
import fxpar.ops.parameter_gathers  # noqa: F401  (registers torch.ops.fxpar.gather_parameters)
from fxpar.passes.contracts import broken, ensures
from fxpar.passes.weight_gradients import deferred_weights

aten = torch.ops.aten
GATHER = torch.ops.fxpar.gather_parameters.default
REGATHER = torch.ops.fxpar.regather_parameters.default


def every_trained_parameter_sharded(gm: fx.GraphModule) -> None:
    """Ensures (module doc)."""
    nodes = meta.parameter_nodes(gm.graph)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for unit in meta.graph_parameter_units(gm):
        for name in unit.parameters:
            node = nodes[name]
            if not isinstance(meta.placement(node, "dp"), FlatShard):
                raise broken(f"trained parameter {name} is sharded on dp (FlatShard)", node)
            readers = {u.target: u for u in node.users}
            if set(readers) - {GATHER, REGATHER} or GATHER not in readers:
                raise broken(f"parameter {name} is read only by its unit's gather (and regather)", node)
            gather = readers[GATHER]
            reads = [u for piece in gather.users for trim in piece.users for view in trim.users for u in view.users]
            if any(order[u] < order[gather] for u in reads):
                raise broken("a gather comes before every use of what it gathers", gather)
            if REGATHER in readers and any(order[u] > order[readers[REGATHER]] for u in reads):
                raise broken("a regather comes after every use of what it gathers again", readers[REGATHER])


@ensures(every_trained_parameter_sharded)
def shard_parameters(gm: fx.GraphModule, *, mesh: Mesh, reshard_after_forward: bool = False,
                     reduce_dtype: torch.dtype | None = None) -> fx.GraphModule:
    """Shard every trained parameter over dp and gather each layer's before use (module doc);
    `reduce_dtype`: what bf16-mixed sums gradients in (None: the pieces' compute dtype)."""
    if deferred := deferred_weights(gm):
        raise PlanError(
            f"plan zero=3 reduce-scatters each layer's gradients when backward leaves the layer, "
            f"and the zero-bubble schedule defers weight gradients ({deferred[0]}, ...) to W "
            "actions after it. Fix: schedule=1f1b (or gpipe, interleaved), or zero=2",
            field="zero",
            value=3,
        )
    graph = gm.graph
    # An expert's weights under ep are split over the expert group already, and their
    # gradients are summed over edp, not dp: ZeRO-3 leaves them whole on their ranks.
    trained = meta.trained_parameters(gm) - set(meta.unbucketed_parameters(graph))
    order = {node: i for i, node in enumerate(graph.nodes)}
    nodes = {name: node for name, node in meta.parameter_nodes(graph).items() if name in trained}
    first_use = {name: min(order[u] for u in node.users) for name, node in nodes.items()}
    layers: dict[tuple[str, torch.dtype], list[str]] = {}
    for name in sorted(nodes, key=first_use.__getitem__):
        layers.setdefault((layer_of(name), gm.get_parameter(name).dtype), []).append(name)
    units = []
    for (layer, _), names in sorted(layers.items(), key=lambda item: first_use[item[1][0]]):
        units.append(ParameterUnit(len(units), layer, tuple(names)))
        shards = [nodes[n] for n in names]
        gathered = _store_in_reduce_dtype(shards, reduce_dtype)
        wholes = _gather_before_use(graph, shards, mesh, gathered, before=min(
            (u for n in names for u in nodes[n].users), key=order.__getitem__))
        if reshard_after_forward and layer:  # the root's unit stays whole for backward (module doc)
            _regather_after_use(graph, shards, wholes, mesh, layer, gathered)
    gm.meta[meta.GRAPH_PARAMETER_UNITS] = tuple(units)
    gm.recompile()
    return gm


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its path up to the first numeric part, else the root."""
    match = re.match(r"^((?:[^.]+\.)*?\d+)\.", name)
    return match.group(1) if match else ""


def _store_in_reduce_dtype(shards: list[fx.Node], reduce_dtype: torch.dtype | None) -> torch.dtype | None:
    """Under bf16-mixed with a `reduce_dtype` that is the parameters' master dtype, make the
    pieces their masters (module doc): their values in that dtype, no master beside them.
    Returns the dtype the gather casts to (their compute dtype), else None."""
    masters = {meta.master_dtype(s) for s in shards}
    if reduce_dtype is None or masters != {reduce_dtype}:
        return None
    (computed,) = {s.meta["val"].dtype for s in shards}
    for shard in shards:
        del shard.meta[meta.MASTER_DTYPE]
        shard.meta["val"] = shard.meta["val"].new_empty(shard.meta["val"].shape, dtype=reduce_dtype)
    return computed


def _gather_before_use(graph: fx.Graph, shards: list[fx.Node], mesh: Mesh, dtype: torch.dtype | None, *,
                       before: fx.Node) -> list[fx.Node]:
    """One gather of `shards` (in `dtype`, when not theirs) just before `before`; every other
    use reads its whole value (returned, one node per shard)."""
    whole_shapes = [local_shape(s.meta["val"].shape, meta.placements(s), mesh.sizes) for s in shards]
    for shard in shards:
        meta.set_placement(shard, "dp", FlatShard())
    pieces = [local_shape(s.meta["val"].shape, meta.placements(s), mesh.sizes)[0] for s in shards]
    for shard in shards:  # a stage's graph may read a parameter first deep inside (no inputs: free to move)
        before.prepend(shard)
    wholes = []
    with graph.inserting_before(before):
        gather = graph.call_function(GATHER, (list(shards), "dp", mesh.dp), {"dtype": dtype} if dtype else {})
        _like(gather, before)
        gather.meta[meta.REQUIRES_GRAD] = any(map(meta.requires_grad, shards))
        gather.meta["val"] = [s.meta["val"].new_empty(p * mesh.dp, dtype=dtype) for s, p in zip(shards, pieces)]
        for i, (shard, shape) in enumerate(zip(shards, whole_shapes)):
            flat = graph.call_function(operator.getitem, (gather, i))
            trimmed = graph.call_function(aten.narrow.default, (flat, 0, 0, _numel(shape)))
            whole = graph.call_function(aten.view.default, (trimmed, list(shape)))
            for node, value in ((flat, gather.meta["val"][i]), (trimmed, gather.meta["val"][i][: _numel(shape)])):
                _like(node, before)
                node.meta["val"] = value
                node.meta[meta.REQUIRES_GRAD] = meta.requires_grad(shard)
            _like(whole, before)
            whole.meta["val"] = shard.meta["val"].new_empty(shard.meta["val"].shape, dtype=dtype)
            whole.meta[meta.PLACEMENT] = meta.placements(shard).on("dp", R)
            whole.meta[meta.REQUIRES_GRAD] = meta.requires_grad(shard)
            for user in list(shard.users):
                if user is not gather:
                    user.replace_input_with(shard, whole)
            wholes.append(whole)
    return wholes


def _regather_after_use(graph: fx.Graph, shards: list[fx.Node], wholes: list[fx.Node], mesh: Mesh, layer: str,
                        dtype: torch.dtype | None) -> None:
    """Put the layer's output (module doc) through a regather of `shards`."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    last = _layer_output(max((u for w in wholes for u in w.users), key=order.__getitem__), layer, order)
    value = last.meta.get("val")
    if not isinstance(value, torch.Tensor) or not meta.requires_grad(last):
        raise PlanError(
            f"plan reshard_after_forward=true gathers layer {layer or '<root>'!r} again when "
            f"backward reaches its last use, {meta.describe(last)}, whose output is not one "
            "tensor that backward passes through. Fix: reshard_after_forward=false",
            field="reshard_after_forward",
            value=True,
        )
    with graph.inserting_after(last):
        gate = graph.call_function(REGATHER, (last, list(shards), "dp", mesh.dp), {"dtype": dtype} if dtype else {})
    last.replace_all_uses_with(gate, delete_user_cb=lambda user: user is not gate)
    _like(gate, last)
    gate.meta["val"] = value
    gate.meta[meta.PLACEMENT] = meta.placements(last)
    gate.meta[meta.REQUIRES_GRAD] = True


def _layer_output(last_use: fx.Node, layer: str, order: dict[fx.Node, int]) -> fx.Node:
    """The last node of `layer`'s module path reached from `last_use` through nodes of the
    layer, where it is a tensor backward passes through; else `last_use` (module doc)."""
    if not layer:
        return last_use
    reached, frontier = [last_use], [last_use]
    while frontier:
        frontier = [u for n in frontier for u in n.users
                    if u not in reached and layer_of(meta.module_path(u) + ".") == layer]
        reached += frontier
    outputs = [n for n in reached if isinstance(n.meta.get("val"), torch.Tensor) and meta.requires_grad(n)]
    return max(outputs, key=order.__getitem__, default=last_use)


def _like(node: fx.Node, model: fx.Node) -> None:
    """Give a new node `model`'s module path and stage, for pictures and the pipeline cut."""
    for key in ("nn_module_stack", meta.STAGE):
        if key in model.meta:
            node.meta[key] = model.meta[key]


def _numel(shape) -> int:
    return math.prod(shape)
