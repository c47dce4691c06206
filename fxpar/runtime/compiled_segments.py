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
pieces `pieces` lists:

    embedding, add, norm -> q, views, k, views, v, views, attention, o -> add, norm -> up, GELU, down
    [compiled]              [op by op: the linears record for W]          [compiled]  [op by op]

Each stretch between two linears with at least two ops to fuse is compiled by Inductor whole
(`fullgraph=True`, its own forward and backward), so anything Dynamo cannot trace there is
still the PlanError of `runtime.compiled_forward`, never a silent graph break. A stretch with
nothing to fuse (views, attention, a lone GELU) runs op by op with the linears around it: a
compiled call costs the host about 80 us (Dynamo's guards, AOTAutograd's wrapper), more than
the ops it would spare. The linears' matmuls are extern kernels, where Inductor's fusion stops
in a graph compiled whole too, so the estimate prices the kernels of that graph, with the W
matmuls apart, and each piece's host call (`compiled_calls`, read by
`cost.step_time.compiled_piece_seconds`).

A collective's start and its wait are in one piece, which the schedule pass
(`runtime.collective_schedule`) orders within that piece: a ZeRO-3 gather is issued early only
within the stretch that reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from fxpar.cost.fused_kernels import fusible
from fxpar.ops import deferred_linear

FUSED_AT_LEAST = 2  # ops a stretch must fuse to be compiled (`pieces`)


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


def pieces(graph: fx.Graph) -> list[tuple[bool, list[fx.Node]]]:
    """A zero-bubble stage's ops in the pieces it runs as, in order: (compiled, ops). A stretch
    between deferred linears is compiled when it has at least `FUSED_AT_LEAST` ops Inductor
    generates code for (`cost.fused_kernels.fusible`, the cost model's rule); a stretch of
    views (between q, k and v) or of one op (a GELU) has nothing to fuse, and runs op by op
    with the linears around it, sparing a compiled call (`compiled_calls`)."""
    stretches: list[tuple[bool, list[fx.Node]]] = []
    stretch: list[fx.Node] = []
    for node in [*graph.nodes, None]:
        if node is None or node.target is deferred_linear.linear:
            stretches.append((sum(map(fusible, stretch)) >= FUSED_AT_LEAST, stretch))
            if node is not None:
                stretches.append((False, [node]))
            stretch = []
        elif node.op == "call_function":
            stretch.append(node)
    merged: list[tuple[bool, list[fx.Node]]] = []
    for fused, nodes in stretches:
        if nodes and not fused and merged and not merged[-1][0]:
            merged[-1][1].extend(nodes)  # op-by-op stretches beside each other run as one piece
        elif nodes:
            merged.append((fused, list(nodes)))
    return merged


def compiled_calls(forward: fx.GraphModule) -> tuple[int, int]:
    """What one forward of a rank's module calls under `compile=inductor`, besides kernels:
    (compiled graphs, ops run op by op). A module compiled whole: (1, 0). A zero-bubble stage:
    its compiled pieces, and the ops of the rest (module doc). Its backward calls as many."""
    if not any(node.target is deferred_linear.linear for node in forward.graph.nodes):
        return 1, 0
    cut_at = pieces(forward.graph)
    return (sum(fused for fused, _ in cut_at),
            sum(len(nodes) for fused, nodes in cut_at if not fused))
