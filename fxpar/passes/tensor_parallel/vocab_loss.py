"""Cross entropy over vocabulary-sharded logits, written out in the graph (Megatron-LM's).

The tensor-parallel pass calls `vocab_parallel_cross_entropy` for a `cross_entropy_loss`
whose logits [N, V] are sharded along the vocabulary. Nothing is gathered: each rank works on
its V/t columns, and two all-reduces over the axis complete the per-token sums:

    local_target, outside = fxpar.localize_indices(target, 'tp', V/t)
    global_max = fxpar.all_reduce_max(amax(detach(logits), [1]), 'tp')   # for stability only
    shifted = logits - global_max[:, None]
    picked = gather(shifted, 1, local_target[:, None])[:, 0].masked_fill(outside, 0)
    both = fxpar.all_reduce(stack([picked, sum(exp(shifted), [1])]), 'tp')     # one call: g
    loss = sum((log(both[1]) - both[0]).masked_fill(target == ignore_index, 0))   [/ count]

Under loss=chunked the amax and the sub/gather/exp/sum/stack run as two ops that reduce a
block of rows at a time, `fxpar.chunked_row_max` and `fxpar.chunked_vocab_stats`
(`ops.chunked_loss`), reading bf16-mixed's bf16 logits directly: no [N, V/t] fp32 tensor.

Autograd differentiates it as written: the all-reduce is Megatron's g (identity backward),
so each rank's logits receive softmax - onehot on their own columns, exactly one device's
gradient; the max carries none (shifting by any constant leaves the loss unchanged, hence
the detach). Being ordinary graph nodes, the two collectives are counted, checked and priced
like every other.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import REPLICATED, P, Placement, R, Shard, local_shape
import fxpar.ops.chunked_loss  # noqa: F401  (registers the chunked ops)
from fxpar.passes.chunked_loss import widens_only

aten = torch.ops.aten


def vocab_parallel_cross_entropy(
    graph: fx.Graph, node: fx.Node, *, axis: str, size: int,
    set_placement: Callable[[fx.Node, Placement], None], chunk_rows: int | None = None,
) -> None:
    """Rewrite `node` (aten.cross_entropy_loss on [N, V] logits, V sharded) as above; `node`
    stays the loss, so its users need no change. With `chunk_rows` (plan loss=chunked) the two
    reductions run that many rows at a time (`ops.chunked_loss`), never holding [N, V/t] fp32."""
    logits, target, *rest = node.args
    options = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), rest)) | node.kwargs
    if options.get("weight") is not None or options.get("label_smoothing", 0.0) != 0.0:
        raise PlanError(
            f"vocabulary-parallel cross entropy supports no class weights and no label "
            f"smoothing ({meta.describe(node)}). Fix: replicate the output projection",
            field="tp",
        )
    reduction = options.get("reduction", 1)
    if reduction == 0:
        raise PlanError(f"{meta.describe(node)}: reduction='none' is not supported under tp", field="tp")
    emit = _Emitter(graph, node, set_placement)
    grad = meta.requires_grad(logits)
    # The vocabulary rows of this rank's shard, as `placement` lays out every tp shard
    rows = int(local_shape(logits.meta["val"].shape, REPLICATED.on(axis, Shard(1)), {axis: size})[1])
    localized = emit(torch.ops.fxpar.localize_indices.default, target, axis, rows, placement=[R, R])
    # Each rank's local targets differ; "R" here says only that every rank holds the whole shape.
    local_target = emit(operator.getitem, localized, 0, placement=R)
    outside = emit(operator.getitem, localized, 1, placement=R)
    widened = None
    if chunk_rows is None:
        both = _local_sums(emit, logits, local_target, outside, axis, grad)
    else:
        widened = logits if widens_only(logits) else None
        if widened is not None:  # bf16-mixed's fp32 copy: the chunked ops widen a block at a time
            logits = widened.args[0]
        local_max = emit(torch.ops.fxpar.chunked_row_max.default,
                         emit(aten.detach.default, logits, placement=Shard(1)), chunk_rows, placement=P)
        global_max = emit(torch.ops.fxpar.all_reduce_max.default, local_max, axis, placement=R)
        both = emit(torch.ops.fxpar.chunked_vocab_stats.default, logits, local_target, outside, global_max,
                    chunk_rows, placement=P, grad=grad)
    both = emit(torch.ops.fxpar.all_reduce.default, both, axis, placement=R, grad=grad)
    log_sum = emit(aten.log.default, emit(aten.select.int, both, 0, 1, placement=R, grad=grad), placement=R, grad=grad)
    per_token = emit(aten.sub.Tensor, log_sum, emit(aten.select.int, both, 0, 0, placement=R, grad=grad),
                     placement=R, grad=grad)
    ignored = emit(aten.eq.Scalar, target, options.get("ignore_index", -100), placement=R)
    per_token = emit(aten.masked_fill.Scalar, per_token, ignored, 0.0, placement=R, grad=grad)
    if reduction == 2:  # sum
        node.target, node.args = aten.sum.default, (per_token,)
    else:  # mean over the targets not ignored
        total = emit(aten.sum.default, per_token, placement=R, grad=grad)
        count = emit(aten.sum.default, emit(aten.logical_not.default, ignored, placement=R), placement=R)
        node.target, node.args = aten.div.Tensor, (total, count)
    node.kwargs = {}
    if widened is not None:  # the fp32 copy nothing reads now
        graph.erase_node(widened)


def _local_sums(emit, logits, local_target, outside, axis: str, grad: bool) -> fx.Node:
    """This rank's [target logit, sum of exponentials] per row, both shifted by the row's global
    maximum, written out op by op (the module doc's graph)."""
    local_max = emit(aten.amax.default, emit(aten.detach.default, logits, placement=Shard(1)), [1], placement=P)
    global_max = emit(torch.ops.fxpar.all_reduce_max.default, local_max, axis, placement=R)
    shifted = emit(aten.sub.Tensor, logits, emit(aten.unsqueeze.default, global_max, 1, placement=R),
                   placement=Shard(1), grad=grad)
    picked = emit(aten.gather.default, shifted, 1, emit(aten.unsqueeze.default, local_target, 1, placement=R),
                  placement=P, grad=grad)
    picked = emit(aten.squeeze.dim, picked, 1, placement=P, grad=grad)
    picked = emit(aten.masked_fill.Scalar, picked, outside, 0.0, placement=P, grad=grad)
    sum_exp = emit(aten.sum.dim_IntList, emit(aten.exp.default, shifted, placement=Shard(1), grad=grad), [1],
                   placement=P, grad=grad)
    return emit(aten.stack.default, [picked, sum_exp], placement=P, grad=grad)


class _Emitter:
    """Inserts ops before `node`, with the global value's fake tensor, module path, gradient
    flag and placement that the later passes and the cost model read."""

    def __init__(self, graph: fx.Graph, node: fx.Node, set_placement):
        self.graph, self.node, self.set_placement = graph, node, set_placement
        self.fake_mode = detect_fake_mode([node.args[0].meta["val"]]) or contextlib.nullcontext()

    def __call__(self, target, *args, placement, grad: bool = False) -> fx.Node:
        with self.graph.inserting_before(self.node):
            new = self.graph.call_function(target, args)
        values = fx.node.map_arg(args, lambda n: n.meta["val"])
        with self.fake_mode:
            new.meta["val"] = target(*values)
        new.meta[meta.MODULE_PATH] = meta.module_path(self.node)
        new.meta[meta.REQUIRES_GRAD] = grad
        self.set_placement(new, placement)
        return new
