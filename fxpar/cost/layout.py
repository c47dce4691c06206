"""How a plan divides one step among ranks: each rank's share of compute, state and activations.

The whole-step FLOPs come from the captured graph (`estimate.graph_compute`). What one rank
does comes from the graphs it runs: the tensor-parallel graph, or its pipeline stages. An op
whose output is sharded or partial over the tp group does 1/tp of the op's work on each rank
(over the cp group, on its slice of the sequence, 1/cp);
a replicated op (a norm without sequence parallelism, the residual adds) is done whole by
every rank. A stage counts only the ops it computes (`meta.STAGE`), not the shape
arithmetic every stage recomputes.

Weight gradients: in a schedule that splits each backward into B and W (`fxpar.schedule.schedules`,
[Note: B and W]), W is the gradient of the weights of the stage's linears whose weight is a
trainable parameter no other op reads (`has_weight_gradient`): grad_out^T x, 2 x rows x in x
out FLOPs, the linear's own forward matmul FLOPs (`cost.ops`'s `linear` rule), so half the
linear's backward (Qi et al. 2024, Sec. 2). Every other op's backward (norms, embeddings,
biases, attention) stays in B.

Activations are not shared out here: `cost.activations` runs each rank's own graphs forward
on fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from fxpar.cost.memo import memoised
from fxpar.cost.matmul_table import matmul_shapes
from fxpar.cost.ops import BYTE_KINDS, cost_of, dense_gradients, needing_gradient, op_counts
from fxpar.ir import meta
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.placement import Partial, R, Shard, local_numel
from fxpar.ops.deferred_linear import LINEAR, deferrable, linear as deferred_linear, stands_for
from fxpar.ops.expert_routing import is_grouped_mm



@dataclass(frozen=True)
class Share:
    """One stage's (or the whole graph's) forward work on one tensor-parallel rank."""

    stage: int | None
    matmul_flops: sympy.Expr  # over the global batch; divide by dp for one rank
    attention_flops: sympy.Expr
    weight_gradient_flops: sympy.Expr  # the part of the backward (2 x matmul_flops) run as W
    other_bytes: sympy.Expr
    forward_ops: int
    backward_nodes: int
    parameters: dict[str, int]  # this rank's parameter elements by name
    # What activation checkpointing runs again in backward: the forward of the nodes it marks
    # (`fxpar.ir.recompute_regions`), counted like the forward's terms above.
    recompute_matmul_flops: sympy.Expr = sympy.Integer(0)
    recompute_attention_flops: sympy.Expr = sympy.Integer(0)
    recompute_bytes: sympy.Expr = sympy.Integer(0)
    recompute_ops: int = 0
    # `other_bytes` and `recompute_bytes` by the class of op that moves them (`cost.ops.BYTE_KINDS`).
    bytes_by_kind: dict[str, sympy.Expr] = field(default_factory=dict)
    recompute_bytes_by_kind: dict[str, sympy.Expr] = field(default_factory=dict)
    # The dense matmuls behind `matmul_flops` less attention, each (m, k, n) on this tp rank over
    # the global batch -> how many, as a rate table prices them (`cost.step_time.dense_seconds`):
    # the forward's; the backward's, each gradient its own matmul (`cost.ops.dense_gradients`);
    # of these, the weight gradients a split schedule runs as W; and the forward's that
    # checkpointing runs again.
    dense_shapes: dict[tuple, int] = field(default_factory=dict)
    backward_shapes: dict[tuple, int] = field(default_factory=dict)
    weight_gradient_shapes: dict[tuple, int] = field(default_factory=dict)
    recompute_shapes: dict[tuple, int] = field(default_factory=dict)


def shares(program: CompiledProgram) -> list[Share]:
    """One Share per pipeline stage, or one for a program without a pipeline (memoised with
    the program's graph: `cost.memo`)."""
    return memoised(program.graph_module, "shares", lambda: _shares(program))


def _shares(program: CompiledProgram) -> list[Share]:
    if program.stages is None:
        return [_share(program, None, program.graph_module, lambda node: True)]
    return [_share(program, s.index, s.graph_module, lambda node, i=s.index: node.meta.get(meta.STAGE) == i)
            for s in program.stages]


def _share(program: CompiledProgram, stage: int | None, gm: fx.GraphModule, mine) -> Share:
    """The Share of one graph: the whole program's, or pipeline stage `stage`'s (`mine` tells
    the ops it computes from the shape arithmetic every stage repeats)."""
    tp, cp = program.plan.tp, program.plan.cp
    nodes = [n for n in gm.graph.nodes if n.op != "call_function" or mine(n)]
    matmul = attention = weight = sympy.Integer(0)
    moved = dict.fromkeys(BYTE_KINDS, sympy.Integer(0))
    again = {"matmul": sympy.Integer(0), "attention": sympy.Integer(0), "ops": 0,
             "bytes": dict.fromkeys(BYTE_KINDS, sympy.Integer(0))}
    dense: dict[tuple, int] = {}
    gradients: dict[tuple, int] = {}
    weight_shapes: dict[tuple, int] = {}
    again_shapes: dict[tuple, int] = {}
    needs_grad = needing_gradient(gm, _received(program, gm))
    for node in nodes:
        cost = cost_of(node, program.captured.shape)
        if cost is None:
            continue
        placement, sequence = meta.placement(node, "tp"), meta.placement(node, "cp")
        experts = _expert_split(node, program.plan.ep)
        split = (tp if isinstance(placement, (Shard, Partial)) else 1) * (
            cp if isinstance(sequence, (Shard, Partial)) else 1) * experts
        matmul += cost.matmul_flops / split
        attention += cost.attention_flops / split
        shape = None if cost.shape is None else _local_shape(cost.shape, placement, tp, node, sequence, cp)
        if shape is not None and experts > 1:
            shape = (shape[0] / experts, *shape[1:])
        if shape is not None:
            _count(dense, shape)
            for gradient in dense_gradients(node, shape, needs_grad.__contains__):
                _count(gradients, gradient)
        if has_weight_gradient(node):
            weight += cost.matmul_flops / split
            _count(weight_shapes, matmul_shapes(*shape)["weight_gradient"])
        if cost.matmul_flops == 0:
            moved[cost.kind] += cost.bytes / split
        if meta.recompute_region(node) is not None:
            again["matmul"] += cost.matmul_flops / split
            again["attention"] += cost.attention_flops / split
            again["bytes"][cost.kind] += cost.bytes / split if cost.matmul_flops == 0 else 0
            again["ops"] += 1
            _count(again_shapes, shape)
    forward_ops, backward_nodes = op_counts(gm)
    # A replica's parameters: ZeRO's share of them over dp is cost.memory's to apply.
    parameters = {
        name: local_numel(node.meta["val"].shape, meta.placements(node).on("dp", R), program.mesh.sizes)
        for name, node in meta.parameter_nodes(gm.graph).items()
    }
    moved = {kind: sympy.expand(b) for kind, b in moved.items()}
    again_moved = {kind: sympy.expand(b) for kind, b in again["bytes"].items()}
    return Share(stage, sympy.expand(matmul), sympy.expand(attention), sympy.expand(weight),
                 sum(moved.values(), sympy.Integer(0)), forward_ops, backward_nodes, parameters,
                 sympy.expand(again["matmul"]), sympy.expand(again["attention"]),
                 sum(again_moved.values(), sympy.Integer(0)), again["ops"], moved, again_moved,
                 dense, gradients, weight_shapes, again_shapes)


def _expert_split(node: fx.Node, ep: int) -> int:
    """How many ways a grouped matmul's rows divide: ep where its experts are split over ep
    (`passes.expert_parallel`). Each rank computes only its experts' rows of the expert
    group's gathered tokens, 1/ep of them under uniform routing, the stated assumption (the
    rows a router really sends each expert are known only when it runs)."""
    return ep if is_grouped_mm(node) and isinstance(meta.placement(node.args[1], "ep"), Shard) else 1


def _received(program: CompiledProgram, gm: fx.GraphModule) -> frozenset[str]:
    """A stage's placeholders that carry activations from the stage before: floating values
    that are not the step's inputs (their gradient goes back to that stage)."""
    return frozenset(n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target not in program.input_names
                     and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point())


def _local_shape(shape: tuple, placement, tp: int, node: fx.Node, sequence=R, cp: int = 1) -> tuple:
    """A dense matmul's (m, k, n) on one tp rank: split along n where its output is sharded in
    its last dim (column-parallel), along m where in another (the sequence, under sp), along k
    where its output is partial (row-parallel: each rank reduces over its part of k); and
    along m where cp splits its rows (a rank's slice of the sequence)."""
    m, k, n = shape
    if isinstance(sequence, Shard):
        m = m / cp
    if isinstance(placement, Partial):
        return m, k / tp, n
    if isinstance(placement, Shard):
        last = placement.dim in (-1, node.meta["val"].dim() - 1)
        return (m, k, n / tp) if last else (m / tp, k, n)
    return m, k, n


def _count(shapes: dict[tuple, int], shape: tuple | None) -> None:
    if shape is not None:
        shapes[shape] = shapes.get(shape, 0) + 1


def has_weight_gradient(node: fx.Node) -> bool:
    """Whether a split schedule runs `node`'s weight gradient as W: `node` is a linear that
    `passes.weight_gradients` deferred, or would (a trainable weight only linears read; a
    parameter also read by another op, an embedding tied to the head in the same stage, gets
    its whole gradient in B)."""
    if node.op != "call_function" or stands_for(node) is not LINEAR or len(node.args) < 2:
        return False
    if node.target is deferred_linear:
        return True
    weight = node.args[1]
    return (
        isinstance(weight, fx.Node) and meta.parameter_name(weight) is not None
        and meta.requires_grad(weight) and deferrable(weight)
    )
