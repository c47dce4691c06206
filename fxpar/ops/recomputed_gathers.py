"""ZeRO-3 under `compile=inductor`: the gather for backward as a recomputation the partitioner places.

In eager mode the runtime's gatherer (`runtime.state.parameter_gatherer`) frees a layer's whole
weights after its forward and gathers them again when the layer's `regather_parameters`
backward runs, handing autograd's saved tensors the new values. A compiled module has no saved
tensors to hand over: AOTAutograd's partitioner decides what the forward keeps for backward. So
the compiled form says the same thing in the partitioner's terms, SimpleFSDP's way (Zhang et
al. 2024, arXiv 2411.00284): each re-gathered layer's gather, with the views that cut its
parameters out of the gathered buffer, becomes a recompute region of its own, which the
runtime runs as a checkpoint call (`runtime.step.recompute`) and Dynamo tags MUST_RECOMPUTE.
The partitioner then keeps no gathered value for backward and recomputes the gather, from the
shards, right before the layer's backward first reads a weight: the same all-gather of the same
bytes that the `regather_parameters` call of the step program stands for, which is therefore
dropped from the compiled graph (it would gather a second time):

    eager:     %g = gather_parameters([w0, w1], 'dp', 2)                # kept for backward
               ...layer...
               %y = regather_parameters(%out, [w0, w1], 'dp', 2)        # gathers in backward
    compiled:  %g = gather_parameters([w0, w1], 'dp', 2)   fxpar.recompute: "g recomputed"
               %w0_whole = view(narrow(%g[0], ...))        fxpar.recompute: "g recomputed"
               ...layer...                                 (uses of %y read %out)

The root's layer, which eager mode keeps gathered for backward (`passes.zero3`), stays as it
is, and so does a plan with `reshard_after_forward=false`, whose module has no regather.

On the dp group the compiled step issues the step program's calls in its order: backward
reaches a layer after the previous layer's reduce-scatter (the gather's backward, which
autograd runs as soon as that layer's weight gradients are done), and the recomputed gather
goes out before the layer's first backward op. The gather op tells the two uses apart by
whether autograd's engine is running it (`parameter_gathers.gather`). The runtime's compiled
forward and the estimate's compiled activations (`cost.compiled_activations`) both read the
module this returns, so what is predicted to be kept is what the compiled step keeps.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from fxpar.ir import meta
import fxpar.ops.parameter_gathers  # noqa: F401  (registers the ops)

GATHER = torch.ops.fxpar.gather_parameters.default
REGATHER = torch.ops.fxpar.regather_parameters.default
_CUTS = {operator.getitem, torch.ops.aten.narrow.default, torch.ops.aten.view.default}


def regathered_by_recomputation(module: fx.GraphModule) -> fx.GraphModule:
    """`module` in its compiled form (module doc): a GraphModule over the same parameters whose
    re-gathered layers' gathers are recompute regions and whose regathers are gone; `module`
    itself when it has none."""
    if not any(n.target is REGATHER for n in module.graph.nodes):
        return module
    graph = copy.deepcopy(module.graph)  # nodes copied, meta shallow
    regathered = set()
    for node in [n for n in graph.nodes if n.target is REGATHER]:
        regathered.add(tuple(node.args[1]))
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
    for node in graph.nodes:
        if node.target is GATHER and tuple(node.args[0]) in regathered:
            label = f"{node.name} recomputed"  # one region per layer: labels tell runs apart
            for cut in _cut_out(node):
                cut.meta = {**cut.meta, meta.RECOMPUTE: label}
    compiled = fx.GraphModule(module, graph, class_name=type(module).__name__)
    compiled.meta.update(module.meta)
    return compiled


def _cut_out(gather: fx.Node) -> list[fx.Node]:
    """The gather and the getitem, narrow and view nodes that cut each parameter out of it."""
    found, frontier = [gather], [gather]
    while frontier:
        for user in frontier.pop().users:
            if user.target in _CUTS:
                found.append(user)
                frontier.append(user)
    return found
