"""What Inductor compiles for a rank module: AOTAutograd's partitioned forward and backward.

A compiled module runs two graphs: the forward, which returns the module's outputs and then
what the backward needs from it, and the backward. Inductor makes them with the min-cut
partitioner after its own joint-graph passes and decompositions, so the only faithful way to
know them is to run that very pipeline: `partitioned_graphs` calls
`torch._inductor.compile_fx.compile_fx` on the rank's module in the form the runtime compiles
(`ops.traced_collectives.compiled_form`), under the capture's fake tensors (symbolic batch
and sequence), with an `inner_compile` that keeps the two graphs and generates no code. The
estimate reads both from here and from nowhere else: the activations the forward keeps
(`cost.compiled_activations`) and the kernels each graph runs (`cost.fused_kernels`).

Checkpoint regions are recomputed by the partitioner: their nodes carry the tags
`torch.utils.checkpoint` gives them when Dynamo traces the runtime's checkpoint calls
(`recompute` MUST_RECOMPUTE, `ac_graph_id` per region), so the partitioner sees what it sees at
run time, ZeRO-3's re-gathered layers included (`ops.recomputed_gathers`: the module is first
put in the form the runtime compiles). The backward's copies of those nodes keep the tag
(`recomputed`). Tracing the backward runs Python that may read an axis's index (the
vocabulary-parallel embedding's padding row), so the rank's axes are bound to stand-ins of
its size and index meanwhile (`ir.axes.planned_axes`).

Partitioning a module takes seconds; every plan that gives a rank the same module shares one
(`module_graphs`, memoised beside the capture by `cost.memo.module_key`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils.checkpoint import CheckpointPolicy

from fxpar.cost.fused_kernels import Kernel, kernels
from fxpar.cost.input_pieces import Pieces, boundary_pieces, piece_values
from fxpar.cost.memo import memoised, module_key
from fxpar.ir import meta
from fxpar.ir.axes import PlannedAxis, planned_axes
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.recompute_regions import segments
from fxpar.ops.traced_collectives import compiled_form


@dataclass(frozen=True)
class PartitionedGraphs:
    """The two graphs of one compiled module, and how to read the forward's placeholders and
    outputs: its first `state` placeholders are the module's parameters and buffers, the rest
    the module's own placeholders (`placeholders`, in order); its first `returned` outputs are
    the module's, the rest what it keeps for backward."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    placeholders: tuple[str, ...]
    state: int
    returned: int
    device: torch.device  # the capture's (fake tensors carry it; no GPU needed)


def rank_axes(program: CompiledProgram, rank: int) -> dict[str, PlannedAxis]:
    """`rank`'s position on each mesh axis, as the compiled graphs are traced for it."""
    coord = program.mesh.coord(rank)
    return {axis: PlannedAxis(size, coord[axis]) for axis, size in program.mesh.sizes.items()}


def module_graphs(program: CompiledProgram, module: fx.GraphModule, rank: int) -> PartitionedGraphs:
    """The partitioned graphs of `module`, one of the modules `rank` runs (module doc)."""
    pieces, axes = boundary_pieces(program), rank_axes(program, rank)
    key = module_key(module, "inductor", sorted(pieces.items()), axes)
    return memoised(program.captured.graph_module, f"partitioned_graphs.{key}",
                    lambda: partitioned_graphs(module, axes, pieces))


def partitioned_graphs(module: fx.GraphModule, axes: dict[str, PlannedAxis],
                       pieces: Pieces | None = None) -> PartitionedGraphs:
    """Partition `module` as Inductor would (module doc); `pieces`: the inputs it gets a piece
    of (`cost.input_pieces`)."""
    from torch._inductor.compile_fx import compile_fx  # Inductor loads in seconds: only here

    module = compiled_form(module)  # what the runtime compiles
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    inputs = piece_values(placeholders, pieces or {})
    fake_mode = detect_fake_mode([i for i in inputs if isinstance(i, torch.Tensor)])
    traced = _with_fake_state(module, fake_mode)
    graphs: dict[str, fx.GraphModule] = {}

    def keep(graph: fx.GraphModule, example_inputs, **options):
        graphs.setdefault("backward" if options.get("is_backward") else "forward", graph)
        return lambda *args: None

    with planned_axes(axes), fake_mode, torch._dynamo.config.patch(fake_tensor_cache_enabled=True), \
            _backward_lowered_now():
        compile_fx(traced, inputs, inner_compile=keep)
    return PartitionedGraphs(
        forward=graphs["forward"],
        backward=graphs["backward"],
        placeholders=tuple(n.name for n in placeholders),
        state=len(list(traced.parameters())) + len(list(traced.buffers())),
        returned=len(torch.utils._pytree.tree_leaves(module.graph.output_node().args[0])),
        device=next(i.device for i in inputs if isinstance(i, torch.Tensor)),
    )


def _backward_lowered_now():
    """AOTAutograd lowers a backward that saves no symbolic size for it lazily, at its first
    run (a pipeline's last stage under full checkpointing): make it lower the backward inside
    `compile_fx`, where `keep` sees it."""
    import torch._functorch.config as aot_config

    if hasattr(aot_config, "force_non_lazy_backward_lowering"):
        return aot_config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def graph_kernels(graphs: PartitionedGraphs, readable) -> tuple[list[Kernel], list[Kernel]]:
    """The kernels of the forward and of the backward (`cost.fused_kernels`; the backward's
    recomputed ones marked), read once per partition (memoised with its forward graph)."""
    return memoised(graphs.forward, "kernels", lambda: (
        kernels(graphs.forward, readable), kernels(graphs.backward, readable, recomputed)))


def recomputed(node: fx.Node) -> bool:
    """Whether a node of a partitioned backward is a checkpoint region's op run again."""
    return node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE


def _with_fake_state(module: fx.GraphModule, fake_mode) -> fx.GraphModule:
    """A copy of `module` whose parameters and buffers are fake tensors of their shapes and
    dtypes (the bound module's may live on a GPU, or be the real weights), each parameter in
    the dtype the graph computes it in (under bf16-mixed, `bind` makes the fp32 parameter a bf16
    working copy: `runtime.state.master_weights`), and whose checkpoint regions carry the tags
    of the module doc."""
    traced = copy.deepcopy(module)
    working = {name: node.meta["val"].dtype for name, node in meta.parameter_nodes(traced.graph).items()
               if isinstance(node.meta.get("val"), torch.Tensor)}
    with fake_mode:
        for name, parameter in list(traced.named_parameters()):
            owner, _, attribute = name.rpartition(".")
            dtype = working.get(name, parameter.dtype)
            fake = torch.empty_strided(parameter.shape, parameter.stride(), dtype=dtype)
            traced.get_submodule(owner)._parameters[attribute] = torch.nn.Parameter(
                fake, requires_grad=parameter.requires_grad)
        for name, buffer in list(traced.named_buffers()):
            owner, _, attribute = name.rpartition(".")
            traced.get_submodule(owner)._buffers[attribute] = torch.empty_strided(
                buffer.shape, buffer.stride(), dtype=buffer.dtype)
    for region, run in enumerate(segments(traced.graph.nodes, meta.recompute_region)):
        for node in run:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = region
    return traced


def stage_graphs(program: CompiledProgram, stage: int | None) -> PartitionedGraphs:
    """The partitioned graphs of pipeline stage `stage` (of the whole program for None), as
    the first rank that runs it compiles them."""
    rank, module = stage_module(program, stage)
    return module_graphs(program, module, rank)


def stage_module(program: CompiledProgram, stage: int | None) -> tuple[int, fx.GraphModule]:
    """The first rank that runs pipeline stage `stage` (the whole program for None), and its
    module of it."""
    if stage is None:
        return 0, program.rank_module(0)
    pp = program.schedule.rank_of(stage)
    rank = program.mesh.rank_of(dp=0, pp=pp, tp=0)
    held = [s.index for s in program.stages if program.schedule.rank_of(s.index) == pp]
    return rank, program.stage_modules(rank)[held.index(stage)]
