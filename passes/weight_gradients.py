"""Deferred weight gradients: a stage's linear layers compute their weight gradient in W.

Zero-bubble schedules (`schedules.zero_bubble_h1`) run a stage's backward as two actions: B
(input gradients, which the previous stage waits for) and, later, W (weight gradients). This
pass makes that split possible on a stage graph by routing its linear layers through
`fxpar.runtime.weight_gradients.linear`, whose backward records the weight-gradient matmul for
the W action instead of running it (see that module for why only linear layers).

    before: %linear = call_function[target=torch.ops.aten.linear.default](args = (%x, %w, %b))
    after:  %linear = call_function[target=fxpar.runtime.weight_gradients.linear](args = (%x, %w, %b))

Contract.
Requires: parameters read through get_attr nodes carrying `fxpar.parameter` (trace.capture).
Ensures: every `aten.linear` whose weight is a parameter read *only* by such linears in this
graph calls the deferred op, with the same arguments and the same forward value. A parameter
also read by anything else (a tied embedding in the same stage) keeps autograd's ordinary
gradient, so each parameter gets its gradient in exactly one action per microbatch, B or W.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar import meta
from fxpar.runtime import weight_gradients

LINEAR = torch.ops.aten.linear.default


def defer_weight_gradients(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite `gm` in place (contract in the module doc); returns it, recompiled."""
    for weight in meta.parameter_nodes(gm.graph).values():
        if deferrable(weight):
            for node in weight.users:
                node.target = weight_gradients.linear
    gm.recompile()
    return gm


def deferrable(weight: fx.Node) -> bool:
    """Whether the gradient of the parameter `weight` reads can wait for W: every reader is an
    `aten.linear` that reads it as its weight, and only there (the cost model's criterion too)."""
    readers = list(weight.users)
    return bool(readers) and all(_reads_as_weight(node, weight) for node in readers)


def _reads_as_weight(node: fx.Node, weight: fx.Node) -> bool:
    return (
        node.op == "call_function" and node.target is LINEAR
        and len(node.args) >= 2 and node.args[1] is weight and weight not in (node.args[0], *node.args[2:])
        and not node.kwargs
    )


def deferred_weights(gm: fx.GraphModule) -> list[str]:
    """Names of the parameters whose gradient the W action computes."""
    return [
        name for name, node in meta.parameter_nodes(gm.graph).items()
        if node.users and all(
            user.target is weight_gradients.linear and user.args[1] is node for user in node.users
        )
    ]
