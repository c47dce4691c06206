"""Exact loss under any split of the batch: a mean cross entropy becomes sum / global count.

One device computes a mean cross entropy with `ignore_index` (what Hugging Face models and
`F.cross_entropy` do) as the sum of the per-target losses over the valid targets (those not
equal to `ignore_index`) divided by the number of valid targets *in the whole batch*. Split
over data-parallel ranks and microbatches, a mean per piece weighs each target by 1 / (its
piece's count), and averaging those means is the one-device loss only when every piece holds
as many valid targets as every other: padded labels break it (docs/design.md, decision 12).

So compile rewrites the loss into a sum divided by the step's global count of valid targets,
which arrives as a new graph input:

    before                                            after
      loss = cross_entropy_loss(logits, target)         total = cross_entropy_loss(logits, target,
                                                                 None, 2, -100)      # sum
      return loss                                       loss = div(total, valid_targets)
                                                        return loss

Each microbatch's loss is then its share of the global mean: summed over microbatches and
data-parallel ranks (not averaged) it is the one-device loss, and so are the gradients.

The count depends on the inputs alone (the target is the labels, shifted or reshaped, never a
parameter), so the pass also extracts `count_module`: the nodes that compute the target from
the step's inputs, plus `(target != ignore_index).sum()`. The runtime runs it on each
microbatch before the step and sums over the data-parallel group: as two digits riding in
DDP's first gradient bucket, which then divides the summed gradients by it, or in one small
all-reduce of its own (`fxpar.compiler.lowering.ride_agreements`, `step_start_actions`).

A mean cross entropy plus another term (`ce + 0.02 * aux`: Hugging Face's MoE models add
their routers' load-balancing loss so) is rewritten the same way, the term added to the
rewritten mean and marked (`loss_reduction.STATISTICS`): such a term is made of the batch's
statistics, which `passes.batch_statistics` makes the global batch's.

A loss of any other form (class weights, label smoothing, a loss computed by hand) keeps the
mean of the pieces' means, which equals one device only when the pieces are alike; compile
warns about it once when the plan splits the batch.

Requires: a graph returning its scalar loss (`trace.capture`).
Ensures: `meta.GRAPH_LOSS` holds a `LossReduction`; with `sums`, the graph has one more
placeholder, `valid_targets` (a scalar of the loss's dtype), after the step's inputs.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.graph_paths import ancestors
from fxpar.ir.loss_reduction import COUNT_INPUT, STATISTICS, LossReduction
from fxpar.passes.contracts import broken, ensures

aten = torch.ops.aten
# Losses that average over valid targets: (self, target, weight, reduction, ignore_index, ...).
_MEAN_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default}
_MEAN, _SUM = 1, 2  # torch's reduction enum


def loss_reduction_recorded(gm: fx.GraphModule) -> None:
    """Ensures: `fxpar.loss` on the graph; a sum over valid targets takes their count."""
    reduction = gm.meta.get(meta.GRAPH_LOSS)
    if reduction is None:
        raise broken("the graph records how its loss combines (fxpar.loss)")
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    if reduction.sums and COUNT_INPUT not in names:
        raise broken(f"a loss summed over valid targets takes their count (placeholder {COUNT_INPUT})")


@ensures(loss_reduction_recorded)
def normalise_loss(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite a mean cross entropy / NLL loss into sum / `valid_targets` (see module doc)."""
    output = gm.graph.output_node()
    loss, extra = _cross_entropy_plus(output.args[0])
    reason = _why_not_a_mean_over_targets(loss)
    if reason:
        gm.meta[meta.GRAPH_LOSS] = LossReduction(sums=False, reason=reason)
        return gm
    target, ignore_index = loss.args[1], _argument(loss, 4, "ignore_index", -100)
    count_module = _count_module(gm, target, ignore_index)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        count = gm.graph.placeholder(COUNT_INPUT)
    count.meta["val"] = loss.meta["val"].new_empty(())
    args = list(loss.args) + [None] * max(0, 4 - len(loss.args))
    args[3] = _SUM
    loss.args = tuple(args)
    loss.kwargs = {k: v for k, v in loss.kwargs.items() if k != "reduction"}
    with gm.graph.inserting_after(loss):
        mean = gm.graph.call_function(aten.div.Tensor, (loss, count))
    mean.meta.update({k: v for k, v in loss.meta.items()})
    if extra is None:
        output.args = (mean,)
    else:
        model_sum = output.args[0]
        output.args = (_added(gm.graph, model_sum, mean, extra),)
        gm.graph.erase_node(model_sum)  # (an in-place add would write the sum)
    gm.meta[meta.GRAPH_LOSS] = LossReduction(
        sums=True, count_module=count_module, count_dtype=count.meta["val"].dtype, statistics=extra is not None,
    )
    return gm


def statistics_term(gm: fx.GraphModule) -> fx.Node | None:
    """The term `normalise_loss` finds added to a mean cross entropy in `gm`'s loss, if any."""
    loss, term = _cross_entropy_plus(gm.graph.output_node().args[0])
    return None if _why_not_a_mean_over_targets(loss) else term


def _cross_entropy_plus(loss: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(the cross entropy, the term added to it) for `ce + term` (in place or not), where the
    term does not read the cross entropy; else (`loss`, None)."""
    if loss.op == "call_function" and loss.target in (aten.add.Tensor, aten.add_.Tensor) and not loss.kwargs:
        for ce, term in (loss.args, loss.args[::-1]):
            if (isinstance(ce, fx.Node) and isinstance(term, fx.Node) and ce.target in _MEAN_LOSSES
                    and ce not in ancestors(term) and isinstance(term.meta.get("val"), torch.Tensor)):
                return ce, term
    return loss, None


def _added(graph: fx.Graph, loss: fx.Node, mean: fx.Node, term: fx.Node) -> fx.Node:
    """`mean + term` in place of the model's `loss` (an in-place add becomes a plain one), the
    term marked as the batch's statistics."""
    with graph.inserting_after(loss):
        total = graph.call_function(aten.add.Tensor, (mean, term))
    total.meta.update(loss.meta)
    term.meta[STATISTICS] = True
    return total


def _argument(node: fx.Node, position: int, name: str, default):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _why_not_a_mean_over_targets(loss: fx.Node) -> str:
    """"" when `loss` is a mean cross entropy / NLL this pass can rewrite, else the reason."""
    if loss.op != "call_function" or loss.target not in _MEAN_LOSSES:
        return f"the loss is computed by {getattr(loss.target, '__name__', loss.target)}, not a cross entropy"
    if _argument(loss, 3, "reduction", _MEAN) != _MEAN:
        return "the cross entropy is not mean-reduced"
    if _argument(loss, 2, "weight", None) is not None:
        return "the cross entropy has class weights"
    if _argument(loss, 5, "label_smoothing", 0.0):
        return "the cross entropy smooths labels"
    if any(meta.requires_grad(n) for n in ancestors(loss.args[1])):
        return "the targets depend on parameters"
    return ""


def _count_module(gm: fx.GraphModule, target: fx.Node, ignore_index: int) -> fx.GraphModule:
    """`(*step_inputs) -> number of valid targets`: the target's ancestors, then a count."""
    needed = ancestors(target)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        elif node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    valid = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    graph.output(graph.call_function(aten.sum.default, (valid,)))
    return fx.GraphModule(gm, graph, class_name="CountValidTargets")
