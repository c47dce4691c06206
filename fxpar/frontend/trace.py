"""Capture: an ordinary `nn.Module` and example inputs become one annotated aten-level graph.

fxpar captures with `torch.export.export(strict=False)` (docs/design.md, decision 1): it traces
Hugging Face- and nanoGPT-style code that `fx.symbolic_trace` cannot, yields one uniform aten
op set, and its symbolic shapes are sympy expressions, so the cost model gets FLOPs and bytes
as formulas in batch and sequence for free.

`capture()` then reshapes the exported program into what the rest of fxpar wants:

* parameters and buffers become `get_attr` nodes named by their `model.state_dict()` keys,
  installed in a module hierarchy that mirrors the model's, so `gm.state_dict()` has exactly
  the model's keys. Tied parameters (GPT-2's `lm_head.weight is wte.weight`) are read through
  one canonical name, the first in `model.named_parameters()` order, and the other names are
  kept as aliases of the same `Parameter`;
* every node carries `fxpar.module_path` (`meta.module_path(node)`), e.g. "h.0.attn.q";
* export's dynamic dims (`s95`, `s24`, ...) are renamed to readable symbols: dim 0 of every
  input is `batch`, dim 1 is `seq`;
* the graph returns the scalar loss itself: a model may return it bare, as the first item of
  a tuple, or as the `loss` of a dict or a Hugging Face `ModelOutput`; what else it returns
  (logits) is dropped with the nodes only it needed.

Example inputs are positional or keyword (`fxpar.frontend.model_io`); either way the graph's
placeholders are the inputs in the order given, named after them.

The returned `GraphModule` shares its parameter tensors with the model: nothing is copied, so
a model built on the meta device (no memory) is captured just as well, for planning.

    gm.code (two-layer GPT, abridged):
        def forward(self, idx, targets):
            wte_weight = self.wte.weight
            sym_size_int = torch.ops.aten.sym_size.int(idx, 0)
            ...
            embedding = torch.ops.aten.embedding.default(wte_weight, idx)
            ...
            return cross_entropy_loss
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec

from fxpar.errors import CaptureError
from fxpar.frontend.attribute_writes import AttributeWatch, refuse_attribute_writes
from fxpar.frontend.export_checks import refuse_nested_graphs, warn_fixed_sizes
from fxpar.frontend.filled_buffers import concatenate_filled_buffers
from fxpar.frontend.grad_regions import inline_grad_mode_blocks
from fxpar.frontend.model_io import ExampleInputs, arrange_inputs, check_keywords, loss_leaf, positional_hint
from fxpar.frontend.state_writes import refuse_running_statistics, refuse_state_writes
from fxpar.ir import meta
from fxpar.ir.symbols import dim_symbol
from fxpar.plan.declared import DeclaredPlans, declared_plans

# Readable names of the dynamic dims, by position in an input tensor.
_DIM_NAMES = {0: "batch", 1: "seq"}


@dataclass(frozen=True)
class CapturedGraph:
    """A captured model: its graph, its state, and the names of its symbolic sizes.

    It pickles as what it was made from, the model and a copy of the example inputs, and is
    captured again when loaded: export's graph holds fake tensors and symbolic sizes bound to
    the capture's shape environment, which do not pickle, and capture is deterministic. So
    loading costs one torch.export, and the model's class must be importable where it loads.
    """

    graph_module: fx.GraphModule
    parameters: dict[str, torch.nn.Parameter]  # canonical name -> the model's own Parameter
    buffers: dict[str, torch.Tensor]  # state_dict name -> buffer (persistent or not)
    aliases: dict[str, str]  # tied alias name -> canonical parameter name
    input_names: tuple[str, ...]  # the graph's placeholders: the inputs in the order given
    keyword_inputs: bool  # captured from a dict of keyword inputs (a step takes the same form)
    declared_plans: DeclaredPlans  # the tensor-parallel plans a Hugging Face model declares
    symbols: dict[str, sympy.Symbol]  # "batch", "seq", ... -> readable symbol
    example_sizes: dict[sympy.Symbol, int]  # readable symbol -> its size in the example inputs
    example_shapes: tuple[tuple[int, ...], ...]  # of the example inputs, as given
    _renames: dict[sympy.Symbol, sympy.Symbol] = field(repr=False)  # export symbol -> readable
    # (model, example inputs as given, cloned): what `capture` took, to capture again on load.
    _source: tuple[torch.nn.Module, ExampleInputs] = field(repr=False, compare=False)

    def __reduce__(self) -> tuple:
        return (capture, self._source)

    @property
    def model(self) -> torch.nn.Module:
        """The model captured: its parameters and buffers are the very tensors the graph reads."""
        return self._source[0]

    @property
    def batch(self) -> sympy.Symbol | None:
        """The symbol of the batch dim shared by every input (None if export fixed it)."""
        return self.symbols.get("batch")

    @property
    def example_batch(self) -> int:
        """The batch size of the example inputs (the global batch of one step)."""
        # Read from the example, never `int()` of the graph's SymInt: that would specialise
        # the symbol to a constant in export's ShapeEnv, for every node at once.
        return self.example_shapes[0][0]

    def readable(self, expr: object) -> sympy.Expr:
        """`expr` (an int, SymInt or export's sympy expression) in fxpar's readable symbols."""
        if isinstance(expr, torch.SymInt):
            expr = expr.node.expr
        return sympy.sympify(expr).xreplace(self._renames)

    def shape(self, node: fx.Node) -> tuple[sympy.Expr, ...]:
        """The shape of a tensor-valued node, each dim a sympy expression in readable symbols."""
        return tuple(self.readable(d) for d in node.meta["val"].shape)

    def export_symbols(self, name: str) -> set[sympy.Symbol]:
        """Export's own symbols (`s95`, `s24`) that fxpar calls `name` ("batch", "seq")."""
        return {s for s, readable in self._renames.items() if readable.name == name}

    def sequence_lengths(self, inputs: tuple[torch.Tensor, ...]) -> set[int]:
        """The sizes `inputs` (a step's batch, in graph order) give the `seq` dim."""
        seq = self.symbols.get("seq")
        placeholders = [n for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        return {
            int(x.shape[dim])
            for node, x in zip(placeholders, inputs)
            for dim, size in enumerate(self.shape(node))
            if seq is not None and size == seq
        }

    def parameter_count(self) -> int:
        """Trainable parameters, each tied group counted once."""
        return sum(p.numel() for p in self.parameters.values())

    def arrange(self, args: tuple, kwargs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """A step's batch in the graph's input order, given as the example was
        (`model_io.arrange_inputs`)."""
        return arrange_inputs(self.input_names, args, kwargs, keyword=self.keyword_inputs)


def capture(model: torch.nn.Module, example_inputs: ExampleInputs) -> CapturedGraph:
    """Capture `model(*inputs) -> loss` (or `model(**inputs)`) as one annotated aten graph.

    See the module doc; `example_inputs` is a tuple of tensors or a dict of keyword tensors.
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"fxpar.compile needs a torch.nn.Module, got {type(model).__name__}")
    keyword = isinstance(example_inputs, Mapping)
    if keyword:
        check_keywords(model, example_inputs)
        names, values = list(example_inputs), list(example_inputs.values())
    else:
        values = list(example_inputs)
        names = [f"input {i}" for i in range(len(values))]
    for name, x in zip(names, values):
        if not isinstance(x, torch.Tensor):
            raise CaptureError(
                f"example {name} is a {type(x).__name__}; fxpar.compile takes tensors only "
                "(each input's dim 0 is the batch). Fix: pass configuration to the model's "
                "constructor or its config, not to forward."
            )
    seen: set[int] = set()
    for i, x in enumerate(values):
        # The same tensor passed twice would be captured as one input, wired to both uses.
        if x.untyped_storage().data_ptr() in seen and not x.is_meta:
            values[i] = x.clone()
        seen.add(values[i].untyped_storage().data_ptr())
    if any(p.is_meta for p in model.parameters()):
        # A meta-device model is captured for planning: its inputs live on meta too.
        values = [x.to("meta") for x in values]
    values = tuple(values)

    args, kwargs = ((), dict(zip(names, values))) if keyword else (values, {})
    try:
        with AttributeWatch(model) as watch:
            exported = _export(model, args, kwargs)
    except CaptureError:
        refuse_running_statistics(model)  # the cause, where a BatchNorm's update is it
        raise
    refuse_state_writes(model, exported)  # BatchNorm in train mode, buffer.add_(), ...
    refuse_attribute_writes(watch)  # self.steps += 1, self.eval(), a list appended to, ...
    inline_grad_mode_blocks(exported)  # torch.no_grad() blocks: their ops, on detached inputs
    refuse_nested_graphs(exported)  # autocast blocks, and grad-mode blocks inside blocks
    source = (model, {k: v.detach().clone() for k, v in example_inputs.items()} if keyword
              else tuple(x.detach().clone() for x in example_inputs))
    captured = _unlift(model, exported, values, keyword=keyword, source=source)
    warn_fixed_sizes(captured.input_names, captured.example_shapes)
    return captured


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> ExportedProgram:
    # Dim.AUTO lets export decide which dims stay symbolic instead of failing on the first
    # specialisation; `_unlift` checks that the batch dim survived.
    def dynamic(x: torch.Tensor) -> dict | None:
        return {d: Dim.AUTO for d in range(min(x.dim(), 2))} or None

    dynamic_shapes = {k: dynamic(x) for k, x in kwargs.items()} if kwargs else tuple(map(dynamic, args))
    try:
        # Fake-tensor caching costs more than it saves on one symbolic trace: caching every op
        # of a Hugging Face decoder made capture 1.3-1.5x slower (benchmarks/bench_compile.py).
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            return torch.export.export(
                model, args, kwargs or None, dynamic_shapes=dynamic_shapes, strict=False
            )
    except Exception as error:
        raise CaptureError(_explain_export_failure(model, error, positional=len(args))) from error


def _explain_export_failure(model: torch.nn.Module, error: Exception, *, positional: int) -> str:
    """Name the cause, the innermost module of the model on the failing stack, and a hint."""
    paths = {id(m): name for name, m in model.named_modules()}
    module, where = None, None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if id(owner) in paths:
            module = paths[id(owner)] or "<root module>"
            where = f"{frame.f_code.co_filename}:{lineno} in {frame.f_code.co_name}"
    text = f"{type(error).__name__}: {error}".strip()
    first_lines = "\n".join(text.splitlines()[:6])
    if "data-dependent" in text or "GuardOnDataDependent" in text:
        hint = (
            "the model branches on the value of a tensor (an `if` on a tensor, `.item()`, "
            "`.tolist()`); make the branch depend on shapes or configuration only"
        )
        if module is not None and module.rsplit(".", 1)[-1] == "experts":  # a loop over the experts hit
            hint += (
                ". A Hugging Face mixture of experts that loops over the experts its router chose does: "
                "build it with experts_implementation='grouped_mm' (transformers' default), which "
                "runs every expert at once with static shapes, as fxpar (and ep=N) needs"
            )
    elif "use_cache" in text or "Cache" in text:
        hint = "for Hugging Face models pass `use_cache=False` in the config"
    else:
        hint = (
            "check that `model(*example_inputs)` runs eagerly and returns the loss; Hugging "
            "Face models need `use_cache=False`"
        )
    if positional > 1:  # e.g. labels bound to GPT-2's `past_key_values`
        hint += f"; {positional_hint(model, positional)}"
    location = f"in module {module!r} ({where})" if module else "outside the model's modules"
    return f"could not capture the model: {first_lines}\n  where: {location}\n  hint: {hint}"


def _unlift(
    model: torch.nn.Module,
    exported: ExportedProgram,
    example_inputs: tuple[torch.Tensor, ...],
    *,
    keyword: bool,
    source: tuple[torch.nn.Module, ExampleInputs],
) -> CapturedGraph:
    """Export's graph as the `CapturedGraph` the module doc describes: the state export lifted
    into inputs read back through get_attr nodes (`_read_state_through_getters`), the loss
    returned, every node annotated (`_annotate`), the dynamic dims renamed."""
    graph = exported.graph_module.graph
    named_parameters = dict(model.named_parameters(remove_duplicate=False))
    canonical = _canonical_parameter_names(model)
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    persistent = set(model.state_dict(keep_vars=True))

    attributes, input_names = _read_state_through_getters(graph, exported, named_parameters, canonical, named_buffers)
    _return_the_loss(graph, exported, model, positional=0 if keyword else len(example_inputs))
    concatenate_filled_buffers(graph)  # DeepSeek-V3's keys: an empty tensor filled by slices
    _annotate(graph, attributes)

    gm = fx.GraphModule(attributes, graph, class_name=type(model).__name__ + "Graph")
    aliases = {n: canonical[n] for n in named_parameters if canonical[n] != n}
    gm.meta[meta.GRAPH_ALIASES] = aliases
    gm.meta[meta.GRAPH_NON_PERSISTENT] = tuple(n for n, _ in gm.named_buffers() if n not in persistent)
    restore_state_layout(gm)

    renames, symbols, sizes = _readable_symbols(graph, example_inputs)
    used = {n for n in attributes if n in named_parameters}
    return CapturedGraph(
        graph_module=gm,
        parameters={n: named_parameters[n] for n in named_parameters if n in used},
        buffers={n: b for n, b in named_buffers.items() if n in attributes},
        aliases=aliases,
        input_names=tuple(input_names),
        keyword_inputs=keyword,
        declared_plans=declared_plans(model),
        symbols=symbols,
        example_sizes=sizes,
        example_shapes=tuple(tuple(x.shape) for x in example_inputs),
        _renames=renames,
        _source=source,
    )


def _read_state_through_getters(
    graph: fx.Graph,
    exported: ExportedProgram,
    named_parameters: dict[str, torch.nn.Parameter],
    canonical: dict[str, str],
    named_buffers: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Replace each placeholder export lifted the model's state into by a get_attr node of
    that state's name, one per name (tied parameters read their canonical one), placed before
    the first compute node. Returns the tensors the GraphModule will hold, by name, and the
    names of the placeholders left: the user's inputs."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    attributes: dict[str, torch.Tensor] = {}
    getters: dict[str, fx.Node] = {}
    input_names: list[str] = []
    for node, spec in zip(placeholders, exported.graph_signature.input_specs, strict=True):
        if spec.kind == InputKind.USER_INPUT:
            input_names.append(node.name)
            continue
        name, value = _lifted_state(spec, exported, named_parameters, canonical, named_buffers)
        attributes[name] = value
        if name not in getters:
            with graph.inserting_before(first_compute):
                # create_node, not get_attr: the attribute lands on the new GraphModule below,
                # so get_attr's check against export's module would only warn.
                getters[name] = graph.create_node("get_attr", name)
            getters[name].meta.update(node.meta)
            if spec.kind == InputKind.PARAMETER:
                getters[name].meta[meta.PARAMETER] = name
        node.replace_all_uses_with(getters[name])
        graph.erase_node(node)
    return attributes, input_names


def _lifted_state(
    spec: InputSpec,
    exported: ExportedProgram,
    named_parameters: dict[str, torch.nn.Parameter],
    canonical: dict[str, str],
    named_buffers: dict[str, torch.Tensor],
) -> tuple[str, torch.Tensor]:
    """The name and tensor of the state a lifted input `spec` stands for: a parameter (by its
    canonical name), a buffer or a constant; any other kind of input is refused."""
    if spec.kind == InputKind.PARAMETER:
        name = canonical[spec.target]
        return name, named_parameters[name]
    if spec.kind == InputKind.BUFFER:
        return spec.target, named_buffers[spec.target]
    if spec.kind == InputKind.CONSTANT_TENSOR:
        return spec.target, exported.constants[spec.target]
    raise CaptureError(
        f"the captured graph has a {spec.kind.name} input {spec.target!r}, which fxpar "
        "does not support; remove custom objects and effectful ops from the model"
    )


def _annotate(graph: fx.Graph, attributes: dict[str, torch.Tensor]) -> None:
    """Give every node its module path and whether it requires grad, and turn views into
    reshapes (below)."""
    for node in graph.nodes:
        node.meta[meta.MODULE_PATH] = meta.exported_module_path(node)
        node.meta[meta.REQUIRES_GRAD] = _requires_grad(node, attributes)
        if node.target is torch.ops.aten.view.default:
            # Export drops a `.contiguous()` that is a no-op for the kernel it traced with (the
            # CPU attention output is already laid out for `transpose(1, 2).view(B, T, C)`);
            # another kernel, or a local shard, may return other strides. reshape is view
            # where view works and copies where it must.
            node.target = torch.ops.aten.reshape.default


def _requires_grad(node: fx.Node, attributes: dict[str, torch.Tensor]) -> bool:
    """Whether autograd will compute a gradient for this value (export's fake values don't say).

    True for trainable parameters and for floating-point results of anything that depends on
    one; called in graph order, so inputs are decided first.
    """
    value = node.meta.get("val")
    if node.op == "get_attr":
        return bool(getattr(attributes.get(node.target), "requires_grad", False))
    if node.op != "call_function" or node.target is torch.ops.aten.detach.default:
        return False
    floating = isinstance(value, torch.Tensor) and value.is_floating_point() or isinstance(value, (list, tuple))
    return floating and any(n.meta.get(meta.REQUIRES_GRAD, False) for n in node.all_input_nodes)


def _canonical_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Map every parameter name to the first name of the same tensor (tied weights share one)."""
    first: dict[int, str] = {}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    return names


def _return_the_loss(
    graph: fx.Graph, exported: ExportedProgram, model: torch.nn.Module, *, positional: int
) -> None:
    """Make the graph return the scalar loss alone; drop what only other outputs needed."""
    output = graph.output_node()
    (values,) = output.args
    spec = exported.call_spec.out_spec
    index, found = loss_leaf(spec)
    loss = values[index] if index is not None else None
    value = loss.meta.get("val") if isinstance(loss, fx.Node) else None
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
        hint = f" ({positional_hint(model, positional)})" if positional > 1 else ""
        raise CaptureError(
            f"fxpar.compile expects the model to return its scalar loss, found {found}. Fix: "
            "return the loss, a tuple whose first item is the loss, or an output with a `loss` "
            f"(Hugging Face models compute it when given `labels`){hint}"
        )
    output.args = (loss,)
    # Not graph.eliminate_dead_code(): it lints get_attr targets against export's module,
    # which no longer owns the state. Parameters stay, used or not: the state keeps the
    # model's keys.
    for node in reversed(graph.nodes):
        if node.op == "call_function" and not node.users and not node.is_impure():
            graph.erase_node(node)


def restore_state_layout(gm: fx.GraphModule) -> None:
    """Make `gm.state_dict()` carry exactly the keys of `model.state_dict()` again.

    A GraphModule built from a graph copies only what get_attr nodes read, and registers every
    tensor as a persistent buffer. So: register each tied alias (`lm_head.weight`) as the same
    Parameter as its canonical name (`gm.parameters()` still yields it once), and keep the
    model's non-persistent buffers (rotary tables) and lifted constants out of the state dict.
    A pipeline stage holds only some of the model's state: only what it holds is restored.
    """
    held = {n for n, _ in gm.named_buffers()}
    for name in meta.graph_non_persistent(gm):
        if name in held:
            owner_path, _, leaf = name.rpartition(".")
            gm.get_submodule(owner_path)._non_persistent_buffers_set.add(leaf)
    parameters = {n for n, _ in gm.named_parameters()}
    for alias, name in meta.graph_aliases(gm).items():
        if name not in parameters:
            continue
        *prefix, leaf = alias.split(".")
        module = gm
        for part in prefix:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        setattr(module, leaf, gm.get_parameter(name))


def _readable_symbols(
    graph: fx.Graph, example_inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[sympy.Symbol, sympy.Symbol], dict[str, sympy.Symbol], dict[sympy.Symbol, int]]:
    """Rename export's `s95`-style symbols of the inputs' dims to `batch`, `seq`, `dim2`, ..."""
    renames: dict[sympy.Symbol, sympy.Symbol] = {}
    symbols: dict[str, sympy.Symbol] = {}
    sizes: dict[sympy.Symbol, int] = {}
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    for node, example in zip(inputs, example_inputs, strict=True):
        for dim, size in enumerate(node.meta["val"].shape):
            if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
                continue
            name = _DIM_NAMES.get(dim, f"dim{dim}")
            if name in symbols and sizes[symbols[name]] != example.shape[dim]:
                name = f"{name}_{node.name}"  # same position, different size: its own symbol
            symbol = symbols.setdefault(name, dim_symbol(name))
            sizes[symbol] = int(example.shape[dim])
            renames[size.node.expr] = symbol
    return renames, symbols, sizes
