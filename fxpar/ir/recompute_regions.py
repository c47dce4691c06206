"""Which nodes activation checkpointing recomputes in backward, and how they group into calls.

One rule, read by the pass that marks a rank's graph (`passes.activation_checkpoint`), by the
cost model that prices the captured graph (`cost.activations`, `cost.layout`) and, through
the marks, by the runtime that recomputes (`runtime.step.recompute`):

    checkpoint=full       every node of a transformer block. The blocks are the children of a
                          block list: a module whose children are named 0, 1, 2, ... (at least
                          two of them) and all of one class, as `transformer.h` or
                          `model.layers` (`block_lists`). A node belongs to the outermost
                          block on its module path, `h.3` for `h.3.attn.q`. A model without a
                          block list cannot be checkpointed per block: `block_lists` is empty
                          and the pass list raises a PlanError.
    checkpoint=selective  attention's core only (Korthikanti et al. 2022, Sec. 5): for an
                          explicit attention, QK^T, everything between it and the softmax
                          (scale, mask, soft-capping, reshapes), the softmax, its dropout
                          and the attention-times-V matmul; for
                          `scaled_dot_product_attention` (fused or math kernel)
                          the one SDPA call (with its dropout mask's draw, where
                          `passes.random_draws` drew it). Its inputs (q, k, v, the mask: projection
                          outputs, which are kept) stay saved; what its kernel saves for
                          backward (the math kernel's s x s probabilities, a flash kernel's
                          output and logsumexp) is recomputed. The linear projections'
                          outputs are never recomputed.

A distributed op (`torch.ops.fxpar.*`) whose forward is a collective (tensor parallelism's g,
sequence parallelism's all-gather and reduce-scatter) is in no region: its output is kept
like a region's input, and a block that holds such ops recomputes as several calls, one per
stretch between them. One exception, by design: context parallelism's gathers of keys and
values (`regathered`), which would otherwise keep the whole sequence's keys and values
where the rank's own slice suffices. They join the region of the attention that reads them
(its core under selective, its block under full), so backward gathers them again before it
recomputes the attention, and the step program lists that gather where backward makes it
(`compiler.lowering.graph_calls`). Only in eager mode: a compiled graph's recomputation is
Inductor's partitioner's, which keeps what it gathered (`regather=False`). An op whose forward is local and whose
collective is in its backward (f, `copy_to_region`: identity forward, all-reduce backward;
`split_to_shard`) may be recomputed: recomputing its forward communicates nothing, and
autograd runs its backward once, from the forward's own graph, as without checkpointing.
ZeRO-3's ops are in no region either, `regather_parameters` included (local forward): its
backward re-gathers the layer, and the layer's regions, which end before it, recompute from
those weights (`runtime.state.parameter_gatherer`), so it must run before their recomputation.

`segments(nodes, label)` cuts a graph's marked nodes into those calls: maximal runs of
consecutive call_function nodes with one label (get_attr nodes, parameters and constants,
and unmarked nodes that read nothing of the run, neither join nor end it: they are inputs). The runtime outlines each run into one
`torch.utils.checkpoint` call; the cost model counts what each run keeps (its inputs) and
recomputes (its ops), so the two agree by construction.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from fxpar.ir import meta  # noqa: F401  (random_ops registers the ops named below)
from fxpar.ops import random_ops
from fxpar.ops.distributed import COMMUNICATING, distributed_op

FULL, SELECTIVE = "full", "selective"

aten = torch.ops.aten
_SDPA = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
# fxpar's random draws (`fxpar.ops.random_ops`, written by `passes.random_draws`): dropout is
# `x * random_like(detach(x))`, SDPA's dropout a drawn mask and the attention that keeps it.
_RANDOM_LIKE = torch.ops.fxpar.random_like.default
_ATTENTION_MASK = torch.ops.fxpar.attention_dropout_mask.default
_MASKED_SDPA = torch.ops.fxpar.attention_with_dropout_mask.default
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
_MATMUL = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default}
# Ops between QK^T and the softmax (scale, mask, casts, Gemma-2's tanh soft-capping, Bloom's
# reshape of its baddbmm), and between it and the PV matmul (dropout, casts, reshapes).
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SCORE_OPS = {
    aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor,
    aten.sub.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
    aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.tanh.default, *_VIEWS,
}
_PROB_OPS = {
    aten.dropout.default, aten.mul.Tensor, aten.native_dropout.default, aten.to.dtype, aten._to_copy.default,
    aten.type_as.default, aten.clone.default, aten.contiguous.default, operator.getitem, *_VIEWS,
}
# export's check before a `.to()`: it reads the value it checks, returns nothing, and goes
# with that value into the core (recomputing a check is free; leaving it out would cut the core).
_CHECK = aten._assert_tensor_metadata.default


def block_lists(graph: fx.Graph) -> tuple[str, ...]:
    """Module paths of the model's block lists (module doc), outermost only, e.g. ("h",)."""
    children: dict[str, dict[str, set[str]]] = {}
    for node in graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            parent, _, last = path.rpartition(".")
            if last.isdigit():
                children.setdefault(parent, {}).setdefault(last, set()).add(_class_name(kind))
    lists = [
        parent for parent, kids in children.items()
        if len(kids) >= 2 and len(set().union(*kids.values())) == 1
    ]
    return tuple(sorted(p for p in lists if not any(_inside(p, q) for q in lists if q != p)))


def block_of(path: str, lists: Iterable[str]) -> str | None:
    """The outermost block (`h.3`) on module path `path` (`h.3.attn.q`), else None."""
    for parent in sorted(lists, key=len):
        rest = path if parent == "" else path[len(parent) + 1:] if path.startswith(parent + ".") else None
        if rest:
            index = rest.split(".")[0]
            if index.isdigit():
                return f"{parent}.{index}" if parent else index
    return None


def region_labels(graph: fx.Graph, mode: str, blocks: tuple[str, ...], *, regather: bool = False) -> dict[fx.Node, str]:
    """Each recomputed node of `graph` under checkpoint=`mode`, with its region's label; with
    `regather`, context parallelism's key and value gathers join their attention's region."""
    if mode == FULL:
        labels = {
            node: block for node in graph.nodes
            if node.op == "call_function" and (block := block_of(meta.module_path(node), blocks))
        }
    elif mode == SELECTIVE:
        labels = attention_cores(graph)
        if regather:
            labels |= {g: labels[a] for a in list(labels) if a.target in _SDPA for g in a.args[1:3]
                       if isinstance(g, fx.Node) and regathered(g)}
    else:
        return {}
    return {node: label for node, label in labels.items()
            if (not communicates_in_forward(node) or (regather and regathered(node))) and not _gathers_parameters(node)}


def regathered(node: fx.Node) -> bool:
    """Context parallelism's gather of a key or value for attention, and nothing else: a
    gather over cp whose only user is SDPA (module doc)."""
    op = distributed_op(node)
    return (op is not None and op.name == "gather_to_region" and node.args[1] == "cp"
            and len(node.users) == 1 and next(iter(node.users)).target in _SDPA)


def _gathers_parameters(node: fx.Node) -> bool:
    """ZeRO-3's ops (module doc): the regather too, whose forward is local, ends a region."""
    op = distributed_op(node)
    return op is not None and op.many


def communicates_in_forward(node: fx.Node) -> bool:
    """Whether `node` is a distributed op whose forward is a collective (module doc)."""
    op = distributed_op(node)
    return op is not None and op.forward in COMMUNICATING


def attention_cores(graph: fx.Graph) -> dict[fx.Node, str]:
    """The nodes of every attention core (module doc), labelled `<module path>:core`."""
    labels: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SDPA:
            core = [node, *(u for u in node.users if u.target is operator.getitem)]
        elif node.target is _MASKED_SDPA:
            core = [node, *(a for a in node.all_input_nodes if a.target is _ATTENTION_MASK)]
        elif node.target in _SOFTMAX:
            core = _explicit_core(node)
        else:
            continue
        for member in core:
            labels[member] = f"{meta.module_path(node)}:core"
    return labels


def _explicit_core(softmax: fx.Node) -> list[fx.Node]:
    """QK^T ... softmax ... PV, or [] where the softmax is not between two matmuls."""
    up, node = [], softmax.args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SCORE_OPS:
        up.append(node)
        up += [u for u in node.users if u.target is _CHECK]
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target in _MATMUL):
        return []
    scores, down, node = node, [], softmax
    while True:
        draws = [u for u in node.users if _draws_from(u)]
        down += [n for draw in draws for n in (draw, *draw.users)]
        checks = [u for u in node.users if u.target is _CHECK]
        down += checks
        users = [u for u in node.users if u not in draws and u not in checks]
        previous = node
        if len(users) != 1:
            return []
        (node,) = users
        if node.target in _MATMUL and node.args[0] is previous:
            return [scores, *reversed(up), softmax, *down, node]
        if node.target not in _PROB_OPS:
            return []
        down.append(node)


def _draws_from(node: fx.Node) -> bool:
    """`node` is the detach a dropout's mask is drawn like (`fxpar.ops.random_ops`)."""
    return node.target is aten.detach.default and bool(node.users) and all(
        u.target is _RANDOM_LIKE for u in node.users)


def segments(nodes: Iterable[fx.Node], label: Callable[[fx.Node], str | None]) -> list[list[fx.Node]]:
    """The recomputed calls: maximal runs of consecutive call_function nodes with one label
    (module doc). get_attr nodes, and unmarked nodes that read nothing of the run (shape
    arithmetic, an attention mask's slice), are skipped over: they run before the run's call,
    which takes their values as inputs. Any other node ends a run."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    current_label = None
    for node in nodes:
        mark = label(node) if node.op == "call_function" else None
        if mark is None and _skipped_over(node, current):
            continue
        if mark is None or mark != current_label:
            if current:
                runs.append(current)
            current, current_label = ([node], mark) if mark is not None else ([], None)
        else:
            current.append(node)
    if current:
        runs.append(current)
    return runs


def _skipped_over(node: fx.Node, run: list[fx.Node]) -> bool:
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    inside = set(run)
    return not any(source in inside for source in node.all_input_nodes)


def segment_inputs(segment: list[fx.Node]) -> list[fx.Node]:
    """The values a segment reads from outside it, in order of first use."""
    inside, found = set(segment), {}
    for node in segment:
        for source in node.all_input_nodes:
            if source not in inside:
                found.setdefault(source, None)
    return list(found)


def segment_outputs(segment: list[fx.Node]) -> list[fx.Node]:
    """The segment's values read after it."""
    inside = set(segment)
    return [node for node in segment if any(user not in inside for user in node.users)]


def _inside(path: str, parent: str) -> bool:
    return parent == "" or path.startswith(parent + ".")


def _class_name(kind) -> str:
    return kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
