"""State a forward writes: buffers and parameters updated in place, refused at capture.

fxpar compiles a training step that is a function of the parameters and the batch: each rank
runs it on its own piece of the batch, and only gradients are synchronised. A forward that
also *writes* state breaks that without a word: BatchNorm in train mode updates its running
mean and variance from the rank's piece, so every data-parallel rank trains statistics of its
own (and a pipeline rank updates a copy no other rank sees); `self.steps.add_(1)` counts per
rank; a weight rescaled under `torch.no_grad()` drifts apart across ranks. So `trace.capture`
refuses such a model, naming the tensor, its module and the fix (`refuse_state_writes`).

How torch.export 2.13 records a write. Non-strict export returns the training IR, which keeps
in-place ops as they are, and keeps BatchNorm whole:

    add_ = torch.ops.aten.add_.Tensor(b_bn_num_batches_tracked, 1)
    batch_norm = torch.ops.aten.batch_norm.default(linear, p_bn_weight, p_bn_bias,
        b_bn_running_mean, b_bn_running_var, True, 0.1, 1e-05, False)      # training=True

`batch_norm`'s schema does not mark its running statistics as written (its decomposition
does the update), and the graph signature's `buffers_to_mutate` stays empty: it is filled
only once the program is functionalised (`run_decompositions`), where each write becomes an
output. So a write is found in one of three ways:

1. an op whose schema marks an argument as written (`Tensor(a!) self`: `add_`, `copy_`,
   `zero_`, `mul_`, ...) applied to a parameter, a buffer, a lifted tensor constant, or a
   view of one (`b.view(-1)[0:2].zero_()`), also inside the regions export wraps in
   higher-order ops (`with torch.no_grad():` becomes `wrap_with_set_grad_enabled(False,
   body, *inputs)`, `torch.autocast` becomes `wrap_with_autocast(..., body, *inputs)`);
2. a normalisation in training mode given running statistics (`_RUNNING_STATISTICS`);
3. the signature's `BUFFER_MUTATION` and `PARAMETER_MUTATION` outputs, should export hand
   back a functionalised program.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from fxpar.errors import CaptureError
from fxpar.ir.meta import exported_module_path

aten = torch.ops.aten

# Normalisations whose decomposition updates running statistics: op -> (index of the
# training / use_input_stats flag, indices of running_mean and running_var).
_RUNNING_STATISTICS = {
    aten.batch_norm.default: (5, (3, 4)),
    aten.native_batch_norm.default: (5, (3, 4)),
    aten.instance_norm.default: (5, (3, 4)),
}

StateKind = Literal["parameter", "buffer", "tensor constant"]
_KIND_OF_INPUT: dict[InputKind, StateKind] = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "tensor constant",
}


@dataclass(frozen=True)
class StateWrite:
    """One write of the model's state in forward."""

    kind: StateKind
    name: str  # its model.state_dict() name (or the attribute's, for a tensor constant)
    op: str  # what wrote it: "aten.add_.Tensor", "aten.batch_norm.default in training mode"
    module_path: str  # the module whose forward wrote it ("" for the root module)
    grad_enabled: bool  # False inside `with torch.no_grad()`


def find_state_writes(exported: ExportedProgram) -> list[StateWrite]:
    """Every write of a parameter, buffer or tensor constant in `exported`, once per tensor,
    in graph order (see the module doc)."""
    graph_module = exported.graph_module
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    roots = {
        node: (_KIND_OF_INPUT[spec.kind], spec.target)
        for node, spec in zip(placeholders, exported.graph_signature.input_specs)
        if spec.kind in _KIND_OF_INPUT
    }
    writes: list[StateWrite] = []
    _walk(graph_module, roots, writes, grad_enabled=True)
    for spec in exported.graph_signature.output_specs:
        if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION):
            kind: StateKind = "buffer" if spec.kind == OutputKind.BUFFER_MUTATION else "parameter"
            writes.append(StateWrite(kind, spec.target, "an in-place update", "", True))
    first: dict[str, StateWrite] = {}
    for write in writes:
        first.setdefault(write.name, write)
    return list(first.values())


def batch_statistics_modules(graph: fx.Graph) -> list[str]:
    """Module paths of the normalisations that use the statistics of their input batch
    (`batch_norm` in training mode, with or without running statistics).

    They write nothing once `track_running_stats=False`, yet a plan that splits the batch
    (dp x microbatches > 1) normalises each piece by its own statistics, not the global batch's,
    as DDP without SyncBatchNorm does: `fxpar.compile` warns."""
    found = []
    for node in graph.nodes:
        batch_norm = node.target in (aten.batch_norm.default, aten.native_batch_norm.default)
        if node.op == "call_function" and batch_norm and node.args[5] is True:
            if (path := exported_module_path(node)) not in found:
                found.append(path)
    return found


def refuse_state_writes(model: torch.nn.Module, exported: ExportedProgram) -> None:
    """Raise CaptureError naming the first tensor forward writes, its module and the fix."""
    writes = find_state_writes(exported)
    if writes:
        raise CaptureError(_explain(model, writes))


def refuse_running_statistics(model: torch.nn.Module) -> None:
    """Raise CaptureError for the first normalisation module in training mode that keeps
    running statistics: what the writes found in an exported program stand for, read from the
    modules themselves. `trace.capture` asks when export itself fails, since some of them
    cannot be exported at all (BatchNorm with `momentum=None` turns its step counter into a
    Python float, a data-dependent value export refuses), so the user learns what to change
    instead of reading export's guard error."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.training and module.track_running_stats:
            op = f"{type(module).__name__} in training mode"
            names = [f"{path}.{b}" if path else b for b in ("running_mean", "running_var", "num_batches_tracked")]
            raise CaptureError(_explain(model, [StateWrite("buffer", n, op, path, True) for n in names]))


def _walk(
    graph_module: fx.GraphModule,
    roots: dict[fx.Node, tuple[StateKind, str]],
    writes: list[StateWrite],
    *,
    grad_enabled: bool,
) -> None:
    """Collect writes of `roots` (state inputs, and the views of them found on the way)."""
    region_outputs: dict[fx.Node, dict[int, tuple[StateKind, str]]] = {}
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            region_outputs[node] = _walk_region(graph_module, node, roots, writes, grad_enabled)
        elif node.target is operator.getitem:  # one view of a split, or a region's output
            source, index = node.args
            found = roots.get(source) or region_outputs.get(source, {}).get(index)
            if found is not None:
                roots[node] = found
        elif isinstance(node.target, torch._ops.OpOverload):
            _visit_op(node, roots, writes, grad_enabled)


def _visit_op(
    node: fx.Node,
    roots: dict[fx.Node, tuple[StateKind, str]],
    writes: list[StateWrite],
    grad_enabled: bool,
) -> None:
    schema = node.target._schema

    def argument(index: int) -> object:
        if index < len(node.args):
            return node.args[index]
        return node.kwargs.get(schema.arguments[index].name)

    written: list[tuple[object, str]] = []
    aliased = None
    for index, spec in enumerate(schema.arguments):
        if spec.alias_info is None:
            continue
        value = argument(index)
        if spec.alias_info.is_write:
            written += [(v, str(node.target)) for v in (value if isinstance(value, (list, tuple)) else [value])]
        if aliased is None and isinstance(value, fx.Node):
            aliased = value
    if node.target in _RUNNING_STATISTICS:
        flag, statistics = _RUNNING_STATISTICS[node.target]
        if argument(flag) is True:
            written += [(argument(i), f"{node.target} in training mode") for i in statistics]
    for value, op in written:
        if isinstance(value, fx.Node) and value in roots:
            kind, name = roots[value]
            writes.append(StateWrite(kind, name, op, exported_module_path(node), grad_enabled))
    # A view, or an in-place op's result, is the tensor it aliases: later writes through it count.
    returns_alias = bool(schema.returns) and schema.returns[0].alias_info is not None
    if returns_alias and aliased in roots:
        roots[node] = roots[aliased]


def _walk_region(
    graph_module: fx.GraphModule,
    node: fx.Node,
    roots: dict[fx.Node, tuple[StateKind, str]],
    writes: list[StateWrite],
    grad_enabled: bool,
) -> dict[int, tuple[StateKind, str]]:
    """Walk the body of a region op (`wrap_with_set_grad_enabled(enabled, body, *inputs)`,
    `wrap_with_autocast(..., body, *inputs)`); return which of its outputs alias state."""
    bodies = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"]
    if not bodies:
        return {}
    body = graph_module.get_submodule(node.args[bodies[0]].target)
    inputs = node.args[bodies[0] + 1:]
    if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
        grad_enabled = bool(node.args[0])
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    inner = {p: roots[a] for p, a in zip(placeholders, inputs) if isinstance(a, fx.Node) and a in roots}
    _walk(body, inner, writes, grad_enabled=grad_enabled)
    (outputs,) = body.graph.output_node().args
    return {i: inner[out] for i, out in enumerate(outputs) if isinstance(out, fx.Node) and out in inner}


def _explain(model: torch.nn.Module, writes: list[StateWrite]) -> str:
    # Name a running statistic first: BatchNorm's step counter is written before them.
    writes = sorted(writes, key=lambda w: "training mode" not in w.op)
    first = writes[0]
    owner_path = first.name.rpartition(".")[0]
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        owner = None
    owner_type = f" ({type(owner).__name__})" if owner is not None else ""
    owner_text = f"module {owner_path!r}{owner_type}" if owner_path else f"the root module{owner_type}"
    by = first.op + ("" if first.grad_enabled else " under torch.no_grad()")
    where = f"module {first.module_path!r}" if first.module_path else "the root module's forward"
    others = [w.name for w in writes[1:]]
    also = f" (and {len(others)} more: {', '.join(repr(n) for n in others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
    head = (
        f"the model writes {first.kind} {first.name!r} of {owner_text} in place during forward "
        f"({by}, in {where}){also}. "
    )
    if first.kind == "parameter":
        return head + (
            "Each rank would apply the write to its own copy, and the compiled step takes "
            "parameters as inputs that only the optimizer changes. Fix: change parameters "
            "outside forward (after the optimizer step), or express the rescaling as a "
            "function of the parameter in forward (torch.nn.utils.parametrize)"
        )
    if isinstance(owner, torch.nn.modules.batchnorm._NormBase):
        return head + (
            "Under data parallelism every rank would update its own running statistics from its "
            "own piece of the batch, so the ranks' models drift apart silently. Fix: put the "
            f"module in eval mode before capture (`model.get_submodule({owner_path!r}).eval()`: "
            "it normalises with its running statistics and updates nothing), or build it with "
            "track_running_stats=False (each piece of the batch normalised by its own "
            "statistics, as DDP without SyncBatchNorm does); SyncBatchNorm is not supported"
        )
    return head + (
        "Each rank would update its own copy from its own piece of the batch, so the copies "
        "drift apart silently; fxpar trains models whose forward reads state and writes none. "
        "Fix: update the tensor outside forward (between steps), or compute it in forward "
        "without storing it"
    )
