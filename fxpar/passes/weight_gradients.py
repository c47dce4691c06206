"""Deferred weight gradients: a stage's linear layers compute their weight gradient in W.

Zero-bubble schedules (`schedules.zero_bubble_h1`) run a stage's backward as two actions: B
(input gradients, which the previous stage waits for) and, later, W (weight gradients). This
pass makes that split possible on a stage graph by routing its linear layers through
`fxpar.runtime.deferred_linear.linear`, whose backward records the weight-gradient matmul for
the W action instead of running it (see that module for why only linear layers). Where to
record it is an input of the stage, `weight_gradients`: the pipeline executor passes its
`WeightGradientStore` there; left at its default, None, every linear is an ordinary one.

    before: def forward(self, x):
                %linear = call_function[target=torch.ops.aten.linear.default](args = (%x, %w, %b))
    after:  def forward(self, x, weight_gradients = None):
                %linear = call_function[target=fxpar.runtime.deferred_linear.linear](
                    args = (%x, %w, %b, %weight_gradients))

Contract.
Requires: parameters read through get_attr nodes carrying `fxpar.parameter` (trace.capture).
Ensures: every `aten.linear` whose weight is a parameter read *only* by such linears in this
graph calls the deferred op, with the same first three arguments and the same forward value,
and the store input as its fourth. A parameter also read by anything else (a tied embedding in
the same stage) keeps autograd's ordinary gradient, so each parameter gets its gradient in
exactly one action per microbatch, B or W. A graph with such a linear has one more input, the
last, `weight_gradients` (default None: `takes_weight_gradients`); one without is unchanged.
The graph module holds no runtime object: the store comes in with each call.
"""

from __future__ import annotations

import torch.fx as fx

from fxpar.ir import meta
from fxpar.ops import deferred_linear
from fxpar.ops.deferred_linear import deferrable
from fxpar.passes.contracts import broken, ensures

STORE_INPUT = "weight_gradients"  # the deferring stage's input that receives the store


def deferrable_linears_defer(gm: fx.GraphModule) -> None:
    """Ensures: no linear whose weight only linears read is left ordinary, and a graph that
    defers takes the store as its last input."""
    for weight in meta.parameter_nodes(gm.graph).values():
        if deferrable(weight):
            raise broken("every linear whose weight only linears read defers its weight gradient", weight)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if takes_weight_gradients(gm) and placeholders[-1].name != STORE_INPUT:
        raise broken(f"a deferring graph's last input is {STORE_INPUT!r}", placeholders[-1])


@ensures(deferrable_linears_defer)
def defer_weight_gradients(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite `gm` in place (contract in the module doc); returns it, recompiled. A compile
    pass, run on each stage of a zero-bubble schedule (`fxpar.compiler.program.compile`)."""
    linears = [
        node
        for weight in meta.parameter_nodes(gm.graph).values() if deferrable(weight)
        for node in weight.users
    ]
    if not linears:
        return gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before()
    with where:  # the last input: its default must not precede inputs without one
        store = gm.graph.placeholder(STORE_INPUT, default_value=None)
    for node in linears:
        x, weight, bias = (*node.args, None)[:3]
        node.target, node.args = deferred_linear.linear, (x, weight, bias, store)
    gm.recompile()
    return gm


def takes_weight_gradients(gm: fx.GraphModule) -> bool:
    """Whether `gm` defers weight gradients, so its last input is the `WeightGradientStore`."""
    return any(node.target is deferred_linear.linear for node in gm.graph.nodes)


def deferred_weights(gm: fx.GraphModule) -> list[str]:
    """Names of the parameters whose gradient the W action computes."""
    return [
        name for name, node in meta.parameter_nodes(gm.graph).items()
        if node.users and all(
            user.target is deferred_linear.linear and user.args[1] is node for user in node.users
        )
    ]
