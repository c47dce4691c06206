"""The `node.meta` keys fxpar reads and writes, declared once, with typed accessors.

Passes communicate through the graph: a pass that learns something about a node stores it
under a namespaced key here, and later passes and the runtime read it back through these
functions instead of poking at `node.meta` with string literals.

    key                       set by            holds
    fxpar.module_path         trace.capture     "h.0.attn.q": the module that emitted the node
    fxpar.parameter           trace.capture     state_dict name of a get_attr'd parameter
    fxpar.requires_grad       trace.capture     whether autograd computes this value's gradient
    fxpar.bucket              data_parallel     index of the gradient bucket of a parameter
    fxpar.placement           tensor_parallel,  the value's Placements: one Placement per mesh
                              dp_placement      axis (dp, tp), each pass setting its own axis
    fxpar.grad_partial        tensor_parallel,  the axes ("tp", "cp", "edp") over which a
                              context_parallel, replicated parameter's gradient is a partial
                              expert_parallel   sum
    fxpar.stage               pipeline          the pipeline stage that computes the node
    fxpar.master_dtype        mixed_precision   a parameter stored in bf16: the dtype its master
                                                copy is trained in (fp32)
    fxpar.tied_across_stages  pipeline_program  a parameter several stages read (a tied
                                                embedding and head), summed over them
    fxpar.recompute           activation_       the checkpoint region a node belongs to
                              checkpoint        ("h.3", "h.3.attn:core"): recomputed in backward
    fxpar.cp_kind             context_parallel  "whole", "weight" or "tokens": what a value is
                                                made from, which decides its cp placement

Graph-wide facts live in `GraphModule.meta` under the same prefix (see `GRAPH_*` below).
"""

from __future__ import annotations

import torch.fx as fx

from fxpar.ir.buckets import Bucket
from fxpar.ir.loss_reduction import LossReduction
from fxpar.ir.parameter_units import ParameterUnit
from fxpar.ir.placement import REPLICATED, PlacementAxis, Placement, Placements

MODULE_PATH = "fxpar.module_path"
PARAMETER = "fxpar.parameter"
BUCKET = "fxpar.bucket"
PLACEMENT = "fxpar.placement"
REQUIRES_GRAD = "fxpar.requires_grad"
GRAD_PARTIAL = "fxpar.grad_partial"
STAGE = "fxpar.stage"
TIED_ACROSS_STAGES = "fxpar.tied_across_stages"
RECOMPUTE = "fxpar.recompute"
CP_KIND = "fxpar.cp_kind"
MASTER_DTYPE = "fxpar.master_dtype"

# GraphModule.meta keys.
GRAPH_BUCKETS = "fxpar.buckets"  # tuple[Bucket, ...] (passes.data_parallel)
GRAPH_PARAMETER_UNITS = "fxpar.parameter_units"  # ZeRO-3: tuple[ParameterUnit, ...] (passes.zero3)
GRAPH_ALIASES = "fxpar.aliases"  # dict: tied alias name -> canonical parameter name
GRAPH_NON_PERSISTENT = "fxpar.non_persistent"  # buffers kept out of the state dict
GRAPH_LOSS = "fxpar.loss"  # LossReduction (passes.loss_normalisation): how pieces' losses combine
GRAPH_BATCH = "fxpar.dp_batch"  # export's batch-size symbols, which the dp axis splits
GRAPH_SEQ = "fxpar.cp_seq"  # export's sequence-length symbols, which the cp axis splits
GRAPH_STAGES = "fxpar.stages"  # passes.pipeline: each stage's nodes, before the split
GRAPH_STAGE = "fxpar.stage"  # which stage a stage's own GraphModule is
GRAPH_RANK = "fxpar.rank"  # the global rank a rank module was specialised for
GRAPH_COORD = "fxpar.coord"  # that rank's mesh coordinate


def module_path(node: fx.Node) -> str:
    """The dotted path of the module whose forward emitted `node` ("" for the root module)."""
    return node.meta.get(MODULE_PATH, "")


def exported_module_path(node: fx.Node) -> str:
    """The innermost module on torch.export's `nn_module_stack` of `node` ("" for the root
    module): what `trace.capture` stores as `fxpar.module_path`. For export's own graph, before
    capture has annotated it."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for key, (path, _) in stack.items() if key.startswith("L__self__")]
    return paths[-1] if paths else ""


def copy_export_provenance(node: fx.Node, like: fx.Node) -> None:
    """Give a node a pass made the module stack and source line of the node it stands in for
    (torch.export's `nn_module_stack` and `stack_trace`), so module paths and errors name
    where it came from."""
    node.meta.update({key: like.meta[key] for key in ("nn_module_stack", "stack_trace") if key in like.meta})


def parameter_name(node: fx.Node) -> str | None:
    """The canonical state_dict name of the parameter a get_attr node reads, else None."""
    return node.meta.get(PARAMETER)


def parameter_nodes(graph: fx.Graph) -> dict[str, fx.Node]:
    """Every parameter-reading node of `graph`, keyed by canonical parameter name."""
    return {name: node for node in graph.nodes if (name := parameter_name(node)) is not None}


def describe(node: fx.Node) -> str:
    """A one-line location of `node` for error messages: its code and module path."""
    path = module_path(node) or "<root module>"
    return f"{node.format_node()}  (module {path!r})"


def placements(node: fx.Node) -> Placements:
    """The node's placement on every mesh axis (Replicate on an axis no pass placed)."""
    return node.meta.get(PLACEMENT, REPLICATED)


def placement(node: fx.Node, axis: PlacementAxis) -> Placement:
    """The node's placement on mesh axis `axis` ("dp" or "tp")."""
    return placements(node)[axis]


def set_placement(node: fx.Node, axis: PlacementAxis, value: Placement) -> None:
    """Set the node's placement on `axis`, keeping the other axes'."""
    node.meta[PLACEMENT] = placements(node).on(axis, value)


def requires_grad(node: fx.Node) -> bool:
    """Whether autograd computes a gradient for this value (see trace._requires_grad)."""
    return node.meta.get(REQUIRES_GRAD, False)


def master_dtype(node: fx.Node | None):
    """The dtype a bf16 working parameter's master is trained in (`passes.mixed_precision`),
    or None for a parameter trained in its own dtype."""
    return None if node is None else node.meta.get(MASTER_DTYPE)


def graph_aliases(gm: fx.GraphModule) -> dict[str, str]:
    """Tied alias name -> its canonical parameter's (capture's; empty where nothing is tied)."""
    return gm.meta.get(GRAPH_ALIASES, {})


def graph_buckets(gm: fx.GraphModule) -> tuple[Bucket, ...]:
    """The gradient buckets in launch order, once `passes.data_parallel` assigned them."""
    return gm.meta[GRAPH_BUCKETS]


def graph_loss(gm: fx.GraphModule) -> LossReduction:
    """How the pieces' losses combine, once `passes.loss_normalisation` ran."""
    return gm.meta[GRAPH_LOSS]


def graph_parameter_units(gm: fx.GraphModule) -> tuple[ParameterUnit, ...]:
    """ZeRO-3's parameter units in gather order, once `passes.zero3` made them."""
    return gm.meta[GRAPH_PARAMETER_UNITS]


def graph_non_persistent(gm: fx.GraphModule) -> tuple[str, ...]:
    """The buffers capture keeps out of the state dict."""
    return gm.meta.get(GRAPH_NON_PERSISTENT, ())


def stage_of(gm: fx.GraphModule) -> int:
    """Which pipeline stage a stage's (or rank's) GraphModule computes: 0 without a pipeline."""
    return gm.meta.get(GRAPH_STAGE, 0)


def trained_parameters(gm: fx.GraphModule) -> set[str]:
    """The parameters that receive a gradient: exactly those in a gradient bucket
    (`passes.data_parallel.assign_gradient_buckets` ensures it), and the experts' weights
    under expert parallelism, whose gradients are summed over edp instead."""
    bucketed = {name for bucket in graph_buckets(gm) for name in bucket.parameters}
    return bucketed | set(unbucketed_parameters(gm.graph))


def unbucketed_parameters(graph: fx.Graph) -> list[str]:
    """The trained parameters in no gradient bucket: an expert's weights under ep, whose
    gradients are summed over edp (`passes.expert_parallel`)."""
    return partial_gradient_parameters(graph, "edp")


def partial_gradient_parameters(graph: fx.Graph, axis: PlacementAxis = "tp") -> list[str]:
    """Replicated parameters whose gradients each rank of `axis` holds only a summand of."""
    return [n for n, node in parameter_nodes(graph).items() if axis in node.meta.get(GRAD_PARTIAL, ())]


def mark_gradient_partial(node: fx.Node, axis: PlacementAxis) -> None:
    """Say that the parameter of `node` gets only a summand of its gradient on each `axis` rank."""
    node.meta[GRAD_PARTIAL] = (*node.meta.get(GRAD_PARTIAL, ()), axis)


def recompute_region(node: fx.Node) -> str | None:
    """The activation-checkpoint region `node` is recomputed with in backward, else None
    (`passes.activation_checkpoint`)."""
    return node.meta.get(RECOMPUTE)
