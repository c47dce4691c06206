"""Which ops of a zero-bubble stage Inductor compiles, and which run op by op.

Under `schedule=zb-h1 compile=inductor` a stage runs cut at its deferred linears
(`runtime.compiled_segments` has why): the linears run op by op, recording their weight
gradients for W, and each stretch between two of them is compiled whole when it has something
to fuse. The cut is decided here, in the cost layer, because the estimate prices it too: each
compiled piece is a call on the host (`Hardware.compiled_call`), each op run op by op an op's
overhead (`cost.step_time.compiled_piece_seconds`). One rule, read by the runtime and the
estimate alike.
"""

from __future__ import annotations

import torch.fx as fx

from fxpar.cost.fused_kernels import fusible
from fxpar.ops import deferred_linear

FUSED_AT_LEAST = 2  # ops a stretch must fuse to be compiled (`pieces`)


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
    its compiled pieces, and the ops of the rest. Its backward calls as many."""
    if not any(node.target is deferred_linear.linear for node in forward.graph.nodes):
        return 1, 0
    cut_at = pieces(forward.graph)
    return (sum(fused for fused, _ in cut_at),
            sum(len(nodes) for fused, nodes in cut_at if not fused))
