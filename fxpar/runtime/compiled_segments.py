"""A zero-bubble stage under `compile=inductor`: Inductor compiles the stretches between its
deferred linears, and the linears run as they do in eager mode.

ZB-H1 runs a stage's backward as B and, later, W: each deferred linear's backward records its
weight-gradient matmul in the pipeline's `WeightGradientStore` instead of running it
(`ops.deferred_linear`). A graph compiled whole cannot do that. AOTAutograd makes its backward
one autograd node that computes every gradient at once, and the store is a Python object that
compiled code cannot call. torch's own pipelining fails on the same point (pytorch/pytorch
#161904: ZeroBubble schedules with a torch.compiled model), and AReaL turns compilation off for
its zero-bubble schedules.

So the stage graph is cut at its deferred linears (`torch.fx.passes.split_module`), into the
pieces `cost.compiled_pieces.pieces` lists (the estimate reads the same cut):

    embedding, add, norm -> q, views, k, views, v, views, attention, o -> add, norm -> up, GELU, down
    [compiled]              [op by op: the linears record for W]          [compiled]  [op by op]

Each stretch between two linears with at least two ops to fuse is compiled by Inductor whole
(`fullgraph=True`, its own forward and backward), so anything Dynamo cannot trace there is
still the PlanError of `runtime.compiled_forward`, never a silent graph break. A stretch with
nothing to fuse (views, attention, a lone GELU) runs op by op with the linears around it: a
compiled call costs the host about 80 us (Dynamo's guards, AOTAutograd's wrapper), more than
the ops it would spare. The linears' matmuls are extern kernels, where Inductor's fusion stops
in a graph compiled whole too, so the estimate prices the kernels of that graph, with the W
matmuls apart, and each piece's host call (`cost.compiled_pieces.compiled_calls`).

A collective's start and its wait are in one piece, which the schedule pass
(`runtime.collective_schedule`) orders within that piece: a ZeRO-3 gather is issued early only
within the stretch that reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from fxpar.cost.compiled_pieces import pieces


def compiled_between_deferred_linears(
    forward: fx.GraphModule, compile_piece: Callable[[fx.GraphModule], torch.nn.Module],
) -> fx.GraphModule:
    """`forward` cut into its `pieces`, each compiled one replaced by `compile_piece(piece)`.
    The pieces read `forward`'s own parameters and buffers, as the top-level graph passes them
    in (`split_module` keeps `get_attr` where it was)."""
    cut_at = pieces(forward.graph)
    index = {node: i for i, (_, nodes) in enumerate(cut_at) for node in nodes}
    last = 0

    def piece_of(node: fx.Node) -> int:
        nonlocal last
        last = index.get(node, last)  # (get_attr and sym nodes outside `pieces`: where they are)
        return last

    cut = split_module(forward, forward, piece_of, keep_original_order=True, keep_original_node_name=True)
    compiled = {node.name for fused, nodes in cut_at if fused for node in nodes}
    for name, module in list(cut.named_children()):
        if isinstance(module, fx.GraphModule) and any(
                n.op == "call_function" and n.name in compiled for n in module.graph.nodes):
            setattr(cut, name, compile_piece(module))
    return cut
