"""`tp_rules="auto"`: Megatron's tensor-parallel layout, read off the graph's data paths.

In a transformer layer the projections come in pairs with nothing between them that needs the
whole hidden vector (Shoeybi et al. 2019, Sec. 3):

    attention   q, k, v column-parallel -> attention, head by head -> output row-parallel
    MLP         up (and gate) column-parallel -> activation -> down row-parallel

and the input embedding and the output head split the vocabulary (same section). `infer_styles`
finds these by following data from op to op, never by graph order:

* attention is `aten.scaled_dot_product_attention`, or the eager pattern of Hugging Face's
  `eager_attention_forward`, nanoGPT and BERT:

      scores = matmul(q, k^T)   then any of  * scale, / scale, + mask, casts   (_SCORE_OPS)
      probs  = softmax(scores)  then any of  casts, dropout                    (_PROB_OPS)
      out    = matmul(probs, v)

  The projections upstream of q, k and v (through views, splits and rotary math: `_FLOW`)
  are column-parallel; the first projection downstream of `out` is row-parallel.
* an MLP pair is a projection whose output reaches a second projection through `_FLOW` ops with
  an activation on that very path. Every projection that feeds the second one so (SwiGLU's gate
  and up) is column-parallel, the second one row-parallel. Without the activation on the path
  there is no pair: a layer's attention output reaches the next MLP through the residual
  stream and a norm's scaling, which must stay whole.
* a mixture of experts' grouped matmuls (`projections.GroupedProjection`) are an MLP pair per
  layer: the one computing the experts' gate|up column-parallel, the one it feeds row-parallel,
  keyed by parameter (the two weights share the experts module);
* an embedding looked up with token ids straight from an input (not positions from an arange),
  and the projection feeding cross entropy, split the vocabulary ("vocab").

Styles are keyed by the module of each projection's weight (a tied head's weight is the
embedding's, so both end up "vocab").
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.graph_paths import ancestors
from fxpar.passes.tensor_parallel.projections import (
    Projection, grouped_projection_of, packet, projection_of, projections,
)

aten = torch.ops.aten

_ACTIVATIONS = {aten.gelu, aten.silu, aten.relu, aten.tanh, aten.sigmoid, aten.erf}
# Ops a sharded activation flows through unchanged in layout on its way between projections.
_FLOW = {
    aten.view, aten._unsafe_view, aten.reshape, aten.transpose, aten.permute, aten.t,
    aten.unsqueeze, aten.squeeze, aten.contiguous, aten.clone, aten.mul, aten.add, aten.sub,
    aten.neg, aten.cat, aten.slice, aten.repeat_interleave, aten.expand, aten.split,
    aten.split_with_sizes, aten.chunk, aten.dropout, aten.div, aten._to_copy, aten.to,
    *_ACTIVATIONS,
}
_SOFTMAX = {aten.softmax, aten._softmax, aten._safe_softmax}
_CASTS = {aten._to_copy, aten.to, aten.type_as, aten.clone, aten.contiguous, aten.alias}
_SCORE_OPS = {aten.mul, aten.div, aten.add, aten.sub, aten.masked_fill, aten.where, *_CASTS}
_PROB_OPS = {aten.dropout, aten.native_dropout, *_CASTS}

Style = str


def infer_styles(gm: fx.GraphModule) -> dict[str, Style]:
    """Megatron's pairs and the vocabulary-parallel ends, read off the graph (see module doc)."""
    styles: dict[str, Style] = {}
    for q, k, v, out in attention_blocks(gm.graph):
        for source in (q, k, v):
            for producer in upstream_projections(source):
                _set(styles, producer, "colwise")
        for consumer in downstream_projections(out):
            _set(styles, consumer, "rowwise")
    for projection in projections(gm.graph):
        if _module(projection) is None or _module(projection) in styles:
            continue
        for consumer in downstream_projections(projection.node, through_activation=True):
            if _module(consumer) in styles:
                continue
            for producer in upstream_projections(consumer.x):
                _set(styles, producer, "colwise", keep=True)
            _set(styles, consumer, "rowwise")
    styles.update(_expert_pairs(gm.graph))
    for node in gm.graph.nodes:
        if packet(node) is aten.embedding and _reads_an_input(node.args[1]):
            if (name := meta.parameter_name(node.args[0])) is not None:
                styles.setdefault(_module_of(name), "vocab")
        if packet(node) is aten.cross_entropy_loss:
            for producer in upstream_projections(node.args[0]):
                _set(styles, producer, "vocab", keep=True)
    return styles


def _expert_pairs(graph: fx.Graph) -> dict[str, Style]:
    """A mixture of experts' MLP pair, by parameter: the grouped projections of one layer (one
    offsets node) whose rows another of them computed are row-parallel, the others (gate|up)
    column-parallel, each expert split as a dense MLP is (Megatron-Core's expert tensor
    parallelism)."""
    layers: dict[fx.Node, list] = {}
    for node in graph.nodes:
        if (grouped := grouped_projection_of(node)) is not None:
            layers.setdefault(node.args[2] if len(node.args) > 2 else node.kwargs.get("offs"), []).append(grouped)
    styles = {}
    for layer in layers.values():
        for grouped in layer:
            fed = any(other.node in ancestors(grouped.node.args[0]) for other in layer)
            styles[meta.parameter_name(grouped.parameter)] = "rowwise" if fed else "colwise"
    return styles


def attention_blocks(graph: fx.Graph) -> Iterator[tuple[fx.Node, fx.Node, fx.Node, fx.Node]]:
    """(q, k, v, output) of every attention: fused kernels and the eager pattern."""
    for node in graph.nodes:
        if packet(node) is aten.scaled_dot_product_attention:
            yield node.args[0], node.args[1], node.args[2], node
        elif packet(node) in _SOFTMAX and (block := _eager_attention(node)) is not None:
            yield block


def _eager_attention(softmax: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """matmul(q, k^T) -> scale, mask -> softmax -> dropout -> matmul(probs, v), or None."""
    scores = _only(_search(softmax.args[0], _SCORE_OPS, _is_activation_matmul, upward=True))
    probs_times_v = [
        matmul for matmul in _search(softmax, _PROB_OPS, _is_activation_matmul, upward=False)
        if _reaches(softmax, matmul.args[0], _PROB_OPS)
    ]
    out = _only(probs_times_v)
    if scores is None or out is None:
        return None
    return scores.args[0], scores.args[1], out.args[1], out


def _is_activation_matmul(node: fx.Node) -> bool:
    return packet(node) in (aten.matmul, aten.bmm) and projection_of(node) is None


def _search(start: fx.Node, through: set, wanted, *, upward: bool) -> list[fx.Node]:
    """Nodes satisfying `wanted` reached from `start` (itself included) through ops in
    `through`; the search does not go past a node it found."""
    found, stack, seen = [], [start], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if wanted(node):
            found.append(node)
        elif node is start or packet(node) in through or node.target is operator.getitem:
            stack.extend(node.all_input_nodes if upward else node.users)
    return found


def _reaches(source: fx.Node, node: fx.Node, through: set) -> bool:
    """Whether `node` is `source` or derives from it through ops in `through` only."""
    while node is not source:
        if not (packet(node) in through or node.target is operator.getitem) or not node.args:
            return False
        node = node.args[0]
    return True


def _only(nodes: list[fx.Node]) -> fx.Node | None:
    return nodes[0] if len(nodes) == 1 else None


def upstream_projections(node: fx.Node) -> list[Projection]:
    """Projections whose output reaches `node` through `_FLOW` ops only."""
    found = _search(node, _FLOW, lambda n: projection_of(n) is not None, upward=True)
    return [projection_of(n) for n in found]


def downstream_projections(node: fx.Node, *, through_activation: bool = False) -> list[Projection]:
    """Projections that take `node`'s value as their input through `_FLOW` ops only; with
    `through_activation`, only along paths that pass an activation."""
    found, stack, seen = [], [(user, False) for user in node.users], set()
    while stack:
        current, activated = stack.pop()
        if (current, activated) in seen:
            continue
        seen.add((current, activated))
        projection = projection_of(current)
        if projection is not None:
            if activated or not through_activation:
                found.append(projection)
            continue
        if packet(current) in _FLOW or current.target is operator.getitem:
            activated = activated or packet(current) in _ACTIVATIONS
            stack.extend((user, activated) for user in current.users)
    unique = {p.node: p for p in found}
    return list(unique.values())


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _module(projection: Projection) -> str | None:
    name = projection.weight_name
    return _module_of(name) if name is not None else None


def _set(styles: dict[str, Style], projection: Projection, style: Style, *, keep: bool = False) -> None:
    module = _module(projection)
    if module is None:
        return
    if keep:
        styles.setdefault(module, style)
    else:
        styles[module] = style


def _reads_an_input(node: fx.Node) -> bool:
    """True for token ids straight from a graph input (not positions from an arange)."""
    while node.op == "call_function" and packet(node) in _FLOW:
        node = node.args[0]
    return node.op == "placeholder"
