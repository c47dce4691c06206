"""`with torch.no_grad():` inside forward, captured: the block's ops inlined into the one flat
graph fxpar's passes read, with the gradient semantics the block has on one device.

torch.export keeps a block that changes grad mode as a higher-order op calling a subgraph
(routers of mixture-of-experts models compute their top-k under one):

    submod_3 = self.submod_1
    out = torch.ops.higher_order.wrap_with_set_grad_enabled(False, submod_3, h, p_gate_weight)
    getitem_1 = out[0]

On one device nothing computed under `no_grad` records autograd history: no gradient flows out
of the block into what it read (here neither `h` nor the gate's weight gets one through it),
and autograd saves nothing for it. Detaching every tensor the block reads and running its ops
as they are says exactly that:

    detach = torch.ops.aten.detach.default(h)
    detach_1 = torch.ops.aten.detach.default(p_gate_weight)
    linear_1 = torch.ops.aten.linear.default(detach, detach_1)     # the body, inlined
    ...

Forward values are the same ops on the same values, so the loss is bit-identical. A block
that turns grad mode back on (`torch.enable_grad()`, in a forward that runs with it on) changes
nothing and is inlined as it is. A block that holds another such block is left nested, for
`export_checks.refuse_nested_graphs` to refuse with its fix.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.export import ExportedProgram

from fxpar.ir import meta

_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


def inline_grad_mode_blocks(exported: ExportedProgram) -> None:
    """Inline every top-level `wrap_with_set_grad_enabled` block of `exported`'s graph, in
    place (module doc)."""
    gm = exported.graph_module
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SET_GRAD:
            continue
        enabled, body_getter, *inputs = node.args
        body = getattr(gm, body_getter.target)
        if any(n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
               for n in body.graph.nodes):
            continue  # nested blocks: refused by export_checks
        _inline(gm.graph, node, body, inputs, detached=not enabled)
        gm.graph.erase_node(node)
        if not body_getter.users:
            gm.graph.erase_node(body_getter)
            delattr(gm, body_getter.target)
    gm.recompile()


def _inline(graph: fx.Graph, block: fx.Node, body: fx.GraphModule, inputs: list, *, detached: bool) -> None:
    """The body's ops before `block`, fed `inputs` (detached first under no_grad); the block's
    `getitem` users read the body's outputs instead."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    values: dict[fx.Node, object] = {}
    with graph.inserting_before(block):
        for placeholder, value in zip(placeholders, inputs, strict=True):
            if detached and isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                detach = graph.call_function(torch.ops.aten.detach.default, (value,))
                meta.copy_export_provenance(detach, block)
                detach.meta["val"] = value.meta["val"]
                value = detach
            values[placeholder] = value
        outputs = graph.graph_copy(body.graph, values)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(block.users):
        if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not block:
            raise AssertionError(f"a grad-mode block read other than by index: {user.format_node()}")
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
