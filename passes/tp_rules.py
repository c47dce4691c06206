"""Tensor-parallel plan rules: which parameters are split, and how, from module paths.

A rule maps a module-path glob to a style (Shoeybi et al. 2019, Sec. 3):

    style       Linear weight (out, in)    Linear bias    Embedding weight (vocab, dim)
    colwise     Shard(0): split outputs    Shard(0)       Shard(1): split the embedding dim
    rowwise     Shard(1): split inputs     Replicate      Shard(0): split the vocabulary
    vocab       Shard(0): split the vocab  Shard(0)       Shard(0): split the vocabulary
    replicate   Replicate                  Replicate      Replicate

    Plan(tp=2, tp_rules={"h.*.attn.[qkv]": "colwise", "h.*.attn.o": "rowwise"})

Hugging Face's `base_model_tp_plan` dicts are accepted as they are: their style names map onto
these (`colwise_rep` -> colwise, `local_rowwise` -> rowwise, `sequence_parallel` -> replicate,
an embedding's `rowwise` splits the vocabulary, as in Transformers), and their keys, relative to
the base model, also match a path's tail. Modules no rule matches are replicated.

`"auto"` infers the Megatron pairs from the graph instead: projections feeding attention are
column-parallel and the projection of its output row-parallel; a projection whose output passes
an activation into another projection is column-parallel, that second one row-parallel; the
embedding and the projection feeding the loss split the vocabulary.
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Mapping

import torch
import torch.fx as fx

from fxpar import meta
from fxpar.errors import PlanError
from fxpar.placement import R, Placement, Shard

Style = str
STYLES = ("colwise", "rowwise", "vocab", "replicate")
HF_STYLES = {
    "colwise": "colwise", "rowwise": "rowwise", "colwise_rep": "colwise",
    "rowwise_rep": "rowwise", "local_colwise": "colwise", "local_rowwise": "rowwise",
    "gather": "colwise", "local": "replicate", "sequence_parallel": "replicate",
    "replicated_with_grad_allreduce": "replicate", "vocab": "vocab", "replicate": "replicate",
}
aten = torch.ops.aten
_ATTENTION = {aten.scaled_dot_product_attention}
_ACTIVATIONS = {aten.gelu, aten.silu, aten.relu, aten.tanh, aten.sigmoid}
# Ops a sharded activation flows through unchanged on its way between two projections.
_FLOW = {
    aten.view, aten._unsafe_view, aten.reshape, aten.transpose, aten.permute, aten.t,
    aten.unsqueeze, aten.squeeze, aten.contiguous, aten.clone, aten.mul, aten.add, aten.sub,
    aten.neg, aten.cat, aten.slice, aten.repeat_interleave, aten.expand, aten.split,
    aten.split_with_sizes, aten.chunk, aten.dropout, aten.div, aten._to_copy, aten.to,
    *_ACTIVATIONS,
}


def _packet(node: fx.Node):
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def parameter_roles(gm: fx.GraphModule) -> dict[str, tuple[str, str]]:
    """Each parameter's (layer kind, role): ("linear", "weight"), ("embedding", "weight"), ..."""
    roles = {}
    for name, node in meta.parameter_nodes(gm.graph).items():
        for user in node.users:
            packet = _packet(user)
            if packet is aten.linear:
                roles[name] = ("linear", "weight" if user.args[1] is node else "bias")
            elif packet is aten.embedding and user.args[0] is node:
                roles[name] = ("embedding", "weight")
        roles.setdefault(name, ("other", "other"))
    return roles


def placement_for(kind: str, role: str, style: Style) -> Placement:
    if style == "replicate" or kind == "other":
        return R
    if kind == "embedding":
        return Shard(1) if style == "colwise" else Shard(0)
    if role == "bias":
        return R if style == "rowwise" else Shard(0)
    return Shard(1) if style == "rowwise" else Shard(0)


def parameter_placements(
    gm: fx.GraphModule, rules: Mapping[str, str] | str, *, tp: int
) -> dict[str, Placement]:
    """The tensor-parallel placement of every parameter under `rules` (see module doc)."""
    roles = parameter_roles(gm)
    styles = infer_styles(gm) if rules == "auto" else _match_rules(roles, rules)
    fused = fused_projections(gm)
    placements = {}
    for name, (kind, role) in roles.items():
        style = styles.get(_module_of(name), "replicate")
        placement = placement_for(kind, role, style)
        if isinstance(placement, Shard) and placement.dim == 0 and name in fused:
            placement = Shard(0, parts=fused[name])
        if isinstance(placement, Shard):
            size = meta.parameter_nodes(gm.graph)[name].meta["val"].shape[placement.dim]
            if size % tp:
                raise PlanError(
                    f"parameter {name!r} ({style} under tp={tp}) has {size} rows along dim "
                    f"{placement.dim}, not divisible by tp={tp}. Fix: choose tp dividing {size}, "
                    f"or replicate the module: tp_rules={{{_module_of(name)!r}: 'replicate'}}",
                    field="tp",
                    value=tp,
                )
        placements[name] = placement
    return placements


def fused_projections(gm: fx.GraphModule) -> dict[str, int]:
    """Parameters of projections whose output is split into equal blocks: {name: blocks}.

    GPT-2's `c_attn` computes q|k|v in one matmul and splits it. Cutting its weight into tp
    contiguous slices would give rank 0 all of q; as `Shard(0, parts=3)` each rank holds its
    own slice of each block, so the local output splits into local q, k and v heads.
    """
    fused = {}
    for node in gm.graph.nodes:
        if _packet(node) is not aten.linear:
            continue
        width = node.meta["val"].shape[-1]
        for user in node.users:
            packet = _packet(user)
            dim = user.args[2] if len(user.args) > 2 else 0
            if packet in (aten.split, aten.chunk) and dim in (-1, len(node.meta["val"].shape) - 1):
                size = user.args[1]
                blocks = size if packet is aten.chunk else width // size
                if packet is aten.chunk or width % size == 0:
                    for parameter in node.args[1:]:
                        if isinstance(parameter, fx.Node) and meta.parameter_name(parameter):
                            fused[meta.parameter_name(parameter)] = int(blocks)
    return fused


def _match_rules(roles: dict[str, tuple[str, str]], rules: Mapping[str, str]) -> dict[str, str]:
    styles: dict[str, str] = {}
    modules = {_module_of(name) for name in roles}
    for pattern, style in rules.items():
        if style not in HF_STYLES:
            raise PlanError(
                f"tp_rules[{pattern!r}] = {style!r} is not a tensor-parallel style; use one of "
                f"{', '.join(STYLES)} (or a Hugging Face style: {', '.join(sorted(HF_STYLES))})",
                field="tp_rules",
                value=style,
            )
        matched = [m for m in modules if fnmatch.fnmatchcase(m, pattern) or fnmatch.fnmatchcase(m, "*." + pattern)]
        if not matched:
            raise PlanError(
                f"tp_rules[{pattern!r}] matches no module of the model. Module paths with "
                f"parameters look like: {', '.join(sorted(modules)[:6])}. Fix: correct the glob",
                field="tp_rules",
                value=pattern,
            )
        for module in matched:
            styles[module] = HF_STYLES[style]
    # Hugging Face marks an embedding "rowwise" to split its vocabulary: placement_for does.
    return styles


def infer_styles(gm: fx.GraphModule) -> dict[str, Style]:
    """Megatron's pairs, read off the graph (see module doc)."""
    styles: dict[str, Style] = {}
    linears = [n for n in gm.graph.nodes if _packet(n) is aten.linear]

    def weight_module(linear: fx.Node) -> str | None:
        name = meta.parameter_name(linear.args[1]) if isinstance(linear.args[1], fx.Node) else None
        return _module_of(name) if name else None

    def upstream_linears(node: fx.Node, stop: fx.Node | None = None) -> set[fx.Node]:
        found, stack, seen = set(), [node], set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if _packet(current) is aten.linear and current is not stop:
                found.add(current)
            elif _packet(current) in _FLOW or current.target is operator.getitem:
                stack.extend(current.all_input_nodes)
        return found

    def downstream_linear(node: fx.Node) -> fx.Node | None:
        stack, seen = list(node.users), set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if _packet(current) is aten.linear:
                return current
            if _packet(current) in _FLOW or current.target is operator.getitem:
                stack.extend(current.users)
        return None

    for attention in (n for n in gm.graph.nodes if _packet(n) in _ATTENTION):
        for source in attention.args[:3]:
            for linear in upstream_linears(source):
                styles[weight_module(linear)] = "colwise"
        out = downstream_linear(attention)
        if out is not None:
            styles[weight_module(out)] = "rowwise"
    for linear in linears:
        module = weight_module(linear)
        if module is None or module in styles:
            continue
        consumer = downstream_linear(linear)
        if consumer is None or weight_module(consumer) in styles:
            continue
        path = upstream_linears(consumer.args[0], stop=consumer)
        if any(_packet(u) in _ACTIVATIONS for u in _nodes_between(linear, consumer)):
            for producer in path:
                styles.setdefault(weight_module(producer), "colwise")
            styles[weight_module(consumer)] = "rowwise"
    for node in gm.graph.nodes:
        if _packet(node) is aten.embedding and _reads_an_input(node.args[1]):
            name = meta.parameter_name(node.args[0])
            if name:
                styles.setdefault(_module_of(name), "vocab")
        if _packet(node) is aten.cross_entropy_loss:
            for linear in upstream_linears(node.args[0]):
                styles.setdefault(weight_module(linear), "vocab")
    return {m: s for m, s in styles.items() if m is not None}


def _reads_an_input(node: fx.Node) -> bool:
    """True for token ids straight from a graph input (not positions from an arange)."""
    while node.op == "call_function" and _packet(node) in _FLOW:
        node = node.args[0]
    return node.op == "placeholder"


def _nodes_between(start: fx.Node, end: fx.Node) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(start.graph.nodes)}
    return [n for n in start.graph.nodes if order[start] < order[n] < order[end]]
