"""A zero-bubble stage under `compile=inductor`: Inductor compiles the stretches between its
deferred linears, and the linears run as they do in eager mode.

ZB-H1 runs a stage's backward as B and, later, W: each deferred linear's backward records its
weight-gradient matmul in the pipeline's `WeightGradientStore` instead of running it
(`ops.deferred_linear`). A graph compiled whole cannot do that. AOTAutograd makes its backward
one autograd node that computes every gradient at once, and the store is a Python object that
compiled code cannot call. torch's own pipelining fails on the same point (pytorch/pytorch
#161904: ZeroBubble schedules with a torch.compiled model), and AReaL turns compilation off for
its zero-bubble schedules.

So the stage graph is cut at each deferred linear (`torch.fx.passes.split_module`):

    embedding, layer norm  ->  linear (q)  ->  view, transpose  ->  linear (k)  -> ...
    [compiled]                 [eager, W]      [compiled]            [eager, W]

Each linear is a piece of its own that runs op by op and records for W. Every piece between two
of them is compiled by Inductor whole (`fullgraph=True`, its own forward and backward), so
anything Dynamo cannot trace there is still the PlanError of `runtime.compiled_forward`, never a
silent graph break. The linears' matmuls are extern kernels, where Inductor's fusion stops in a
graph compiled whole too. So the pieces run the kernels that one compiled graph of the stage
would run, and the estimate prices that graph, with the W matmuls apart
(`cost.step_time.compiled_piece_seconds`).

What the cut costs: a compiled piece's guards and its own autograd node per stretch (up to
seven per transformer block). A collective's start and its wait are in one piece, which the
schedule pass (`runtime.collective_schedule`) orders within that piece: a ZeRO-3 gather is
issued early only within the stretch that reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from fxpar.ops import deferred_linear


def compiled_between_deferred_linears(
    forward: fx.GraphModule, compile_piece: Callable[[fx.GraphModule], torch.nn.Module],
) -> fx.GraphModule:
    """`forward` cut at its deferred linears (module doc), each piece without one replaced by
    `compile_piece(piece)`. The pieces read `forward`'s own parameters and buffers, as the
    top-level graph passes them in (`split_module` keeps `get_attr` where it was)."""
    stretch = 0

    def piece_of(node: fx.Node) -> int:
        nonlocal stretch
        if node.target is deferred_linear.linear:
            stretch += 2  # the linear alone, then a new stretch after it
            return stretch - 1
        return stretch

    cut = split_module(forward, forward, piece_of, keep_original_order=True, keep_original_node_name=True)
    for name, piece in list(cut.named_children()):
        if isinstance(piece, fx.GraphModule) and not _holds_deferred_linear(piece):
            setattr(cut, name, compile_piece(piece))
    return cut


def _holds_deferred_linear(piece: fx.GraphModule) -> bool:
    return any(node.target is deferred_linear.linear for node in piece.graph.nodes)
