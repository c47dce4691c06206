"""A graph Inductor compiles, as the kernels it runs: what `compile=inductor` is priced by.

Eager mode runs every aten op of a rank's graph as a kernel of its own, so the estimate prices
each op's bytes and charges each op a dispatch (`cost.step_time.piece_seconds`). Inductor runs
the graphs AOTAutograd partitions the rank's step into (`cost.compiled_graphs`) as fewer,
larger kernels, by one rule this module applies to those very graphs:

* extern kernels run as libraries run them, one call each: dense matmuls (`mm`, `addmm`,
  `bmm`, `baddbmm`: BLAS, cuBLAS), attention (the SDPA kernels, forward and backward), and any
  op Inductor has no lowering for (a custom op, a collective: priced elsewhere);
* every other op (pointwise, reductions, gathers, fills, scatters of the embedding's
  gradient) is generated code, and Inductor fuses the ops that no extern kernel separates:
  a fused kernel is a connected set of them, through views, whose ops all sit behind the same
  number of extern kernels (`extern_depth`: two ops with an extern kernel on a path between
  them cannot run in one kernel, as the extern must run between them). A softmax's max,
  exponential, sum and division are one kernel; a residual add and the layer norm after it
  one; the next block's add, behind the attention's matmuls, another;
* a fused kernel reads each tensor it takes from outside once (a view of one as the view's
  elements, at most its base's) and writes each value something outside it reads: its bytes.
  Intermediates inside it stay in registers and are never written.

This is Inductor's vertical and horizontal fusion without its limits (it splits a kernel
whose reductions run over different ranges, and declines fusions it judges unprofitable), so
it is the fewest bytes a compiled graph can move: a lower bound on the fused kernels' bytes,
priced at the rate fused kernels reach (`Hardware.fused_bandwidth`, measured on a compiled
transformer block where it can be). Views and shape arithmetic are free.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from fxpar.cost.ops import MATMUL_RULES, cost_of
from fxpar.ops.distributed import distributed_op

aten = torch.ops.aten

_DENSE = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
# Attention kernels: the forward takes (query, key, value, ...), the backward
# (grad_out, query, key, value, ...) and does twice the forward's FLOPs (`cost.ops`).
_ATTENTION_FORWARD = {
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu,
}
_ATTENTION_BACKWARD = {
    aten._scaled_dot_product_flash_attention_backward, aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward, aten._scaled_dot_product_flash_attention_for_cpu_backward,
}
# Views share their input's storage and launch nothing.
_VIEWS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
    aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.alias, aten.as_strided, aten.diagonal,
    aten.unfold, aten.split, aten.split_with_sizes, aten.unbind,
}


@dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled graph: a dense matmul of `shape` (m, k, n), attention of
    `attention_flops` (its forward's FLOPs, twice them for a backward kernel), or a fused
    kernel (and an extern op without a rule) moving `bytes`; `recomputed` when every op in it
    is one activation checkpointing runs again in backward."""

    kind: str  # "dense", "attention", "fused" or "extern"
    bytes: sympy.Expr = sympy.Integer(0)
    shape: tuple | None = None
    attention_flops: sympy.Expr = sympy.Integer(0)
    recomputed: bool = False


def kernels(graph: fx.GraphModule, readable: Callable[[object], sympy.Expr],
            recomputed: Callable[[fx.Node], bool] = lambda node: False) -> list[Kernel]:
    """The kernels `graph` runs (module doc), sizes as formulas through `readable` (the
    capture's symbols); `recomputed(node)` tells an op activation checkpointing runs again."""
    externs, runs = _kernel_runs(graph)
    found = [_extern(n, readable, recomputed(n)) for n in externs]
    for run in runs:
        moved = _fused_bytes(run, readable)
        found.append(Kernel("fused", moved, recomputed=all(recomputed(n) for n in run)))
    return found


def _kernel_runs(graph: fx.GraphModule) -> tuple[list[fx.Node], list[set[fx.Node]]]:
    """The extern kernels of `graph` in order, and its fused kernels, each the set of its ops."""
    nodes = [n for n in graph.graph.nodes if _launches(n) or _is_view(n)]
    group = _fused_groups(nodes, extern_depth(graph))
    members: dict[int, set[fx.Node]] = {}
    for node, root in group.items():
        members.setdefault(root, set()).add(node)
    return [n for n in nodes if _launches(n) and n not in group], list(members.values())


def _values(node: fx.Node) -> list[fx.Node]:
    """The nodes holding `node`'s tensors: itself, or the getitems of an op returning several."""
    return [node] if _tensor(node) is not None else [u for u in node.users if u.target is operator.getitem]


def extern_depth(graph: fx.GraphModule) -> dict[fx.Node, int]:
    """For each node, the most extern kernels on a path from the graph's inputs to it, itself
    included."""
    depth: dict[fx.Node, int] = {}
    for node in graph.graph.nodes:
        before = max((depth[a] for a in node.all_input_nodes), default=0)
        depth[node] = before + (_launches(node) and not fusible(node))
    return depth


def _fused_groups(nodes: list[fx.Node], depth: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Fusible ops -> the id of the fused kernel they run in: union-find over edges between
    fusible ops (through views) at the same extern depth."""
    parent: dict[fx.Node, fx.Node] = {}

    def root(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for node in nodes:
        if not fusible(node):
            continue
        parent[node] = node
        for source in _producers(node):
            if source in parent and depth[source] == depth[node]:
                parent[root(source)] = root(node)
    return {node: id(root(node)) for node in parent}


def _producers(node: fx.Node) -> list[fx.Node]:
    """The ops whose values `node` reads, looking through views."""
    found = []
    for arg in node.all_input_nodes:
        while _is_view(arg):
            arg = arg.all_input_nodes[0]
        found.append(arg)
    return found


def _fused_bytes(run: set[fx.Node], readable) -> sympy.Expr:
    """Bytes one fused kernel moves: each tensor it reads from outside once, each value of it
    read outside (or returned) once (module doc)."""
    read: dict[fx.Node, sympy.Expr] = {}
    for node in run:
        for arg in node.all_input_nodes:
            base = storage(arg)
            if base not in run and _tensor(arg) is not None:
                read[base] = sympy.Min(_bytes(arg, readable), _bytes(base, readable)) if base is not arg \
                    else _bytes(arg, readable)
    written = sum((_bytes(v, readable) for node in run for v in _values(node)
                   if any(_outside(u, run) for u in v.users)), sympy.Integer(0))
    return sum(read.values(), sympy.Integer(0)) + written


def storage(node: fx.Node) -> fx.Node:
    """The node whose allocation `node`'s value lives in: through views to their base."""
    while _is_alias(node):
        node = node.all_input_nodes[0]
    return node


def _outside(user: fx.Node, run: set[fx.Node]) -> bool:
    """Whether `user` reads its input from outside the kernel `run` (a view reads for its users)."""
    if _is_view(user):
        return any(_outside(u, run) for u in user.users)
    return user not in run


def _extern(node: fx.Node, readable, recomputed: bool) -> Kernel:
    """An extern kernel: its matmul's (m, k, n) and its attention's FLOPs by `cost.ops`' rules,
    which eager mode's pricing reads too; any other op's bytes in and out."""
    target, args = _op(node)
    packet = target.overloadpacket

    def shape_of(value: fx.Node) -> tuple[sympy.Expr, ...]:
        return tuple(readable(d) for d in _tensor(value).shape)

    if packet in _DENSE:
        return Kernel("dense", shape=cost_of(node, shape_of).shape, recomputed=recomputed)
    if packet in _ATTENTION_FORWARD or packet in _ATTENTION_BACKWARD:
        backward = packet in _ATTENTION_BACKWARD
        query_key_value = [shape_of(a) for a in args[backward:backward + 3]]
        flops, _ = MATMUL_RULES[aten.scaled_dot_product_attention](query_key_value, (), ())
        return Kernel("attention", attention_flops=2 * flops if backward else flops, recomputed=recomputed)
    moved = sum((_bytes(a, readable) for a in node.all_input_nodes if _tensor(a) is not None), sympy.Integer(0))
    return Kernel("extern", moved + _bytes(node, readable), recomputed=recomputed)


def _bytes(node: fx.Node, readable) -> sympy.Expr:
    value = _tensor(node)
    if value is None:
        return sympy.Integer(0)
    return sympy.Mul(*(readable(d) for d in value.shape)) * value.element_size()


def _tensor(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _op(node: fx.Node) -> tuple[torch._ops.OpOverload | None, tuple]:
    """The op `node` runs and its arguments, looking into the wrappers the partitioner puts
    around a random op of a checkpoint region (it saves the generator's state in forward and
    runs the op again from it in backward); (None, ()) for a node that runs no op."""
    if node.op != "call_function":
        return None, ()
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target, node.args
    wrapper = getattr(node.target, "__name__", "")
    if wrapper == "run_and_save_rng_state":
        return node.args[0], node.args[1:]
    if wrapper == "run_with_rng_state":
        return node.args[1], node.args[2:]
    return None, ()


def _launches(node: fx.Node) -> bool:
    """An op that runs a kernel: an aten or custom op returning tensors, not a view."""
    target, _ = _op(node)
    return (isinstance(target, torch._ops.OpOverload) and not _is_view(node) and not _communicates(target, node)
            and _returns_tensors(node))


def _returns_tensors(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if value is None:  # the partitioner's wrappers carry their values on their getitems only
        values = [u.meta.get("val") for u in node.users if u.target is operator.getitem]
    else:
        values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) for v in values)


def _is_view(node: fx.Node) -> bool:
    """A view, or one value of an op returning several: no kernel of its own."""
    return (node.op == "call_function" and node.target is operator.getitem) or _is_alias(node)


def _is_alias(node: fx.Node) -> bool:
    """A view of its input's storage."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.overloadpacket in _VIEWS)


def fusible(node: fx.Node) -> bool:
    """Generated code: an aten or prims op that is not an extern kernel (module doc)."""
    if not _launches(node):
        return False
    target, _ = _op(node)
    packet = target.overloadpacket
    if packet in _DENSE or packet in _ATTENTION_FORWARD or packet in _ATTENTION_BACKWARD:
        return False
    return target.namespace in ("aten", "prims")


def _communicates(target: torch._ops.OpOverload, node: fx.Node) -> bool:
    """A collective or its wait: priced per call by the communication model, not here."""
    if target.namespace in ("_c10d_functional", "c10d_functional"):
        return True
    starts = ("collective_start", "backward_collective")
    return target.namespace == "fxpar" and (target.overloadpacket.__name__ in starts or distributed_op(node) is not None)

