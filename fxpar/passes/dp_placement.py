"""Placements on the data-parallel axis.

`place_data_parallel` lays every value out on the dp axis. Each rank runs the whole model on
its slice of the batch, so a value with a batch dim is `Shard(d)` on dp (d where its size
involves the batch), a value computed from such slices without one (the loss's sum, the
count of valid targets) is `Partial` (a summand per rank), and parameters, buffers and what
only they make are `Replicate`. A local shape then follows from the placements
(`placement.local_shape`), as it does on the tp axis: a collective's payload or a pipeline
boundary is the global microbatch's shape cut by both axes.

    before: %linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default](...)
    after:  the same node, with node.meta["fxpar.placement"] = Placements(dp=S(0), tp=...)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.placement import P, R, Shard
from fxpar.passes.contracts import broken, ensures

AXIS = "dp"


def batch_dim(node: fx.Node, batch: frozenset) -> int | None:
    """The first dim of `node`'s value whose size involves one of export's `batch` symbols."""
    for dim, size in enumerate(node.meta["val"].shape):
        if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & batch:
            return dim
    return None


def batch_sharded_on_dp(gm: fx.GraphModule) -> None:
    """Ensures: every tensor node carries placements, and a value with a batch dim is Shard
    there on dp (`fxpar.dp_batch` names export's batch symbols)."""
    batch = gm.meta.get(meta.GRAPH_BATCH, frozenset())
    for node in gm.graph.nodes:
        if not isinstance(node.meta.get("val"), torch.Tensor) or node.op == "output":
            continue
        if meta.PLACEMENT not in node.meta:
            raise broken("every tensor node has placements (fxpar.ir.placement)", node)
        dim = batch_dim(node, batch)
        if dim is not None and meta.placement(node, AXIS) != Shard(dim):
            raise broken(f"a value with its batch in dim {dim} is Shard({dim}) on dp", node)


@ensures(batch_sharded_on_dp)
def place_data_parallel(gm: fx.GraphModule, *, batch: frozenset) -> fx.GraphModule:
    """Set every tensor value's placement on the dp axis (module doc).

    Requires: `batch`, export's symbols of the batch size (`CapturedGraph.export_symbols`);
    empty when the capture fixed the batch (then nothing is split: dp must be 1).
    Ensures: `fxpar.ir.placement` on every tensor node with its dp axis set: Shard(d) where d is
    its first dim sized by the batch, Partial for a batch-free value computed from split or
    partial ones, Replicate otherwise; `gm.meta["fxpar.dp_batch"] = batch`.
    """
    for node in gm.graph.nodes:
        if not isinstance(node.meta.get("val"), torch.Tensor) or node.op == "output":
            continue
        dim = batch_dim(node, batch)
        if dim is not None:
            placement = Shard(dim)
        elif node.op == "call_function" and any(
            meta.placement(source, AXIS) != R for source in node.all_input_nodes if meta.PLACEMENT in source.meta
        ):
            placement = P
        else:
            placement = R
        meta.set_placement(node, AXIS, placement)
    gm.meta[meta.GRAPH_BATCH] = batch
    return gm
