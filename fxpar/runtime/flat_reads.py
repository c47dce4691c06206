"""The forward the executors call reads its tensors without `torch.nn.Module.__getattr__`.

A GraphModule reads a parameter the way its get_attr node names it,

    h_0_ln_1_weight = getattr(self.h, "0").ln_1.weight

which is four calls of `Module.__getattr__` (submodules and parameters live in dictionaries
that ordinary attribute lookup does not search). A small GPT's rank module reads 70 tensors a
forward this way: 3% of its forward's CPU time against the same model written by hand, whose
modules each read their own (`benchmarks/bench_megatron.py`, measured with the `fake` backend
so that only CPU work differs).

So what the executors call is a copy of the rank module's graph whose get_attr nodes read
the same tensor objects under flat names from the copy's instance dictionary, one ordinary
attribute lookup each:

    h_0_ln_1_weight = self.h_0_ln_1_weight

The rank module stays what everything else reads (parameter names, state dicts, the
optimizer's parameters, the graph). The copy holds references, as the optimizer, the gradient
buckets and ZeRO's flat buffers do: after bind a parameter's `.data` may change (device moves,
ZeRO's flat buffers, master weights), the Parameter object never does.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx


def reading_flat(module: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule that runs `module`'s graph, reading each tensor attribute directly."""
    graph = copy.deepcopy(module.graph)  # nodes and codegen copied; meta shallow
    attributes: dict[str, object] = {}
    flat: dict[str, str] = {}  # target -> its flat name
    for node in graph.nodes:
        if node.op == "call_module":
            attributes[node.target] = module.get_submodule(node.target)
        elif node.op == "get_attr":
            value = operator.attrgetter(node.target)(module)  # as `runtime.step.recompute` reads it
            if isinstance(value, torch.Tensor):
                if node.target not in flat:
                    flat[node.target] = _unique("fxpar_" + node.target.replace(".", "_"), attributes)
                node.target = flat[node.target]
            attributes[node.target] = value
    forward = fx.GraphModule(attributes, graph, class_name=type(module).__name__)
    for name in flat.values():  # out of the registries, where lookup goes through __getattr__
        forward._parameters.pop(name, None)
        forward._buffers.pop(name, None)
        forward.__dict__[name] = attributes[name]
    return forward


def _unique(name: str, taken: dict[str, object]) -> str:
    candidate, k = name, 0
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    return candidate
