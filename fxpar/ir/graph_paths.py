"""Paths through a graph: what a node is made from and makes, and which nodes backward reaches.

    ancestors(node)              every node `node` is computed from, itself included
    descendants(node)            every node computed from `node`, itself left out
    nodes_reaching_output(graph) the nodes with a path to the output autograd follows

A value that does not reach the output along floating values (a router's group scores, read
only for the top-k indices they choose; what a forward computes under `torch.no_grad()`, detached by capture:
`frontend.grad_regions`) gives no parameter a gradient, and what autograd saved to compute
its gradient is freed as soon as forward drops the value. Gradient buckets read this (only
parameters that reach the loss are reduced), and so does the activation estimate (only what
reaching ops saved is held for backward).
"""

from __future__ import annotations

import torch
import torch.fx as fx


def ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it is computed from."""
    return _closure([node], lambda n: n.all_input_nodes)


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node computed from `node` (not `node` itself)."""
    return _closure(list(node.users), lambda n: n.users)


def _closure(start: list[fx.Node], step) -> set[fx.Node]:
    seen, stack = set(), start
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def nodes_reaching_output(graph: fx.Graph) -> set[fx.Node]:
    """Nodes with a path to the output that backward follows: a detach ends the path, and so
    does an integer or boolean value (top-k's indices, a mask), through which no gradient
    flows."""
    seen: set[fx.Node] = set()
    stack = [graph.output_node()]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            if node.target is not torch.ops.aten.detach.default:
                stack.extend(n for n in node.all_input_nodes if _carries_gradient(n))
    return seen


def _carries_gradient(node: fx.Node) -> bool:
    """Whether a gradient may flow back through `node`'s value: a floating tensor, or a tuple
    of values (a top-k's, a split's), or one capture gave no value to (kept, to be safe)."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() or value.is_complex()
    return value is None or isinstance(value, (tuple, list))
