"""Recomputation at run time: a rank module's checkpoint regions, each one checkpoint call.

`passes.activation_checkpoint` marks which nodes are recomputed; `recomputing(module, meter)`
returns what the executors call in the module's place: the module itself when nothing is
marked, else a GraphModule with the same parameters (the very Parameter objects, read
through get_attr as before) whose forward runs each marked run of nodes
(`recompute_regions.segments`) as

    torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False)

so autograd keeps only the region's inputs and recomputes the region when backward reaches
it. The non-reentrant variant restores the CPU and device RNG state before recomputing
(`preserve_rng_state`, its default), so a dropout inside a region draws the mask it drew in
forward; it nests with custom autograd functions, the zero-bubble deferred linear included
(its backward records the recomputed input for W). No collective is ever inside a region
(the pass's contract): they stay in the outer forward, in the step program's order, and
recomputation cannot issue one the step guard would refuse. The one exception is made on
purpose: a compiled ZeRO-3 module's layer gathers are regions of their own
(`ops.recomputed_gathers`), whose recomputation is the re-gather the step program lists.

Under ZeRO-3 a block's region reads the layer's gathered weights (the gather is a collective:
outside every region). The checkpoint would keep them, as inputs, from forward to backward,
which is what ZeRO-3 frees; with `reshard_after_forward` the region takes them as the
gatherer's recipes instead and its recomputation reads the re-gathered weights
(`ParameterGatherer.region_input`, wired at bind by `read_gathered_through`, `runtime.binding.step_context`).

The rank module itself keeps its flat graph, which lowering, the pictures and the runtime's
other readers (`takes_weight_gradients`, the partial gradients) read.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from fxpar.ir import meta
from fxpar.ir.recompute_regions import segment_inputs, segment_outputs, segments
from fxpar.runtime.state.parameter_gatherer import ParameterGatherer
from fxpar.runtime.step.saved_tensors import SavedTensorMeter


class RecomputedRegion(torch.nn.Module):
    """One run of marked nodes, as a stateless GraphModule called through checkpoint."""

    def __init__(self, region: fx.GraphModule, meter: SavedTensorMeter | None):
        super().__init__()
        self.region = region
        self.meter = meter
        self.gatherer: ParameterGatherer | None = None  # ZeRO-3's (`read_gathered_through`)

    def forward(self, *inputs):
        if self.gatherer is None:
            outputs = checkpoint(self.region, *inputs, use_reentrant=False)
        else:
            inputs = tuple(map(self.gatherer.region_input, inputs))
            outputs = checkpoint(self._run_on_gathered, *inputs, use_reentrant=False)
        if self.meter is not None:  # (compiled: the compiled graph's own saves are what is held)
            self.meter.hold_inputs(inputs, outputs)  # what the checkpoint keeps for its backward
        return outputs

    def _run_on_gathered(self, *inputs):
        return self.region(*map(self.gatherer.region_value, inputs))


def read_gathered_through(forward: torch.nn.Module, gatherer: ParameterGatherer) -> None:
    """Make the checkpoint regions of `forward` (what `recomputing` returned) take ZeRO-3's
    gathered weights from `gatherer` as recipes, not hold them (module doc)."""
    for region in forward.modules():
        if isinstance(region, RecomputedRegion):
            region.gatherer = gatherer


def recomputing(module: fx.GraphModule, meter: SavedTensorMeter | None) -> fx.GraphModule:
    """What to call in `module`'s place (module doc); without a `meter` (a module Inductor
    compiles, `runtime.compiled_forward`) the regions report nothing to one."""
    runs = segments(module.graph.nodes, meta.recompute_region)
    if not runs:
        return module
    ending = {run[-1]: (index, run) for index, run in enumerate(runs)}
    inside = {node for run in runs for node in run}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attributes: dict[str, object] = {}
    for node in module.graph.nodes:
        if node in ending:
            index, run = ending[node]
            name = f"recompute_{index}"
            attributes[name] = RecomputedRegion(_region_module(run), meter)
            call = graph.call_module(name, tuple(env[i] for i in segment_inputs(run)))
            for position, output in enumerate(segment_outputs(run)):
                env[output] = graph.call_function(operator.getitem, (call, position))
                env[output].meta = dict(output.meta)
        elif node not in inside:
            if node.op == "get_attr":
                attributes[node.target] = operator.attrgetter(node.target)(module)
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(attributes, graph, class_name="RecomputingModule")


def _region_module(run: list[fx.Node]) -> fx.GraphModule:
    """The run as a GraphModule of its own: its inputs as placeholders, its outputs as a tuple."""
    graph = fx.Graph()
    env = {source: graph.placeholder(f"in_{i}") for i, source in enumerate(segment_inputs(run))}
    for node in run:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in segment_outputs(run)))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="RegionGraph")
