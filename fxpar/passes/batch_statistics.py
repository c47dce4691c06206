"""A loss term made of the batch's statistics, computed over the global batch on every rank.

Hugging Face's mixtures of experts (`output_router_logits=True`) add to the cross entropy
their routers' load-balancing loss (Fedus et al. 2021, Switch Transformer, eq. 4):

    aux = E * sum_e f_e * P_e    f_e: the share of the batch's routed rows that expert e got
                                 P_e: the routers' mean probability of e over the batch's tokens

Both are means over the whole batch and their product is no sum over tokens, so a rank that
computes the term from its slice of the batch gets another number, and no average of the ranks'
numbers is one device's (nor is it for ST-MoE's router z-loss, a mean of squares). So under dp
the term's statistics are made the global batch's (`normalise_loss` marks the term):

- each reduction of the rank's tokens in the term (a value sized by the batch reduced to one
  that is not: `Partial` on dp after `place_data_parallel`) is all-reduced over dp: a sum
  (sum, histc) becomes the batch's sum, and a mean is taken as the sum over its count times
  dp, the batch's mean;
- a count the term divides by, made from the rank's batch size, becomes the batch's (times dp);
- the term, now one device's on every rank, joins each rank's loss as
  `term - (dp - 1) / dp * term.detach()`: its value is term / dp, so that the ranks' losses sum
  to one device's, and its gradient is the whole term's.

The all-reduce's backward is the identity (`fxpar.all_reduce`), which is exact: a rank's own
tokens reach the term only through its own summand of each statistic, whose derivative is the
term's by the global statistic. No collective runs in backward, and the ranks' gradients are
summed over dp in the buckets as every other gradient is.

    before:  %counts = histc(%expert_ids, 4)             the rank's rows per expert
             %share  = div(%counts, %rows)               %rows: the rank's batch x seq x k
    after:   %counts = all_reduce(histc(%expert_ids, 4), 'dp')
             %share  = div(%counts, %rows * dp)

The statistics span the step's batch: microbatches (mb > 1, and so pipelines) and cp would
compute them per piece, and are refused.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.graph_paths import descendants
from fxpar.ir.loss_reduction import STATISTICS
from fxpar.ir.placement import Partial, R, Shard
from fxpar.passes.contracts import broken, ensures

aten, fxpar_ops = torch.ops.aten, torch.ops.fxpar
AXIS = "dp"
_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.histc.default}
_MEANS = {aten.mean.default, aten.mean.dim}
_SCALED = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar}  # by a count of the batch


def statistics_global(gm: fx.GraphModule) -> None:
    """Ensures: the loss's statistics term reads each reduction of the rank's tokens all-reduced
    over dp (`fxpar.all_reduce`), where dp splits the batch."""
    if not any(n.target is fxpar_ops.all_reduce.default for n in gm.graph.nodes):
        return  # dp=1 (or no term): nothing to make global
    for term in _terms(gm):
        for node in _token_reductions(term):
            if any(user.target is not fxpar_ops.all_reduce.default for user in node.users):
                raise broken("the statistics term reads each reduction of the tokens all-reduced over dp", node)


@ensures(statistics_global)
def make_statistics_global(gm: fx.GraphModule, *, dp: int) -> fx.GraphModule:
    """Compute the loss's term of batch statistics over the global batch (module doc).

    Requires: dp placements (`place_data_parallel`), the loss normalised (`normalise_loss`),
    and a plan that does not split the batch into pieces (`refuse_batch_pieces`).
    Ensures: every reduction of the tokens in the term all-reduced over dp, the batch counts it
    divides by the global batch's, and the term's value a dp-th share of each rank's loss."""
    for term in _terms(gm) if dp > 1 else ():
        made_global = [_all_reduced(gm.graph, node, dp) for node in _token_reductions(term)]
        downstream = set().union(*(descendants(n) for n in made_global)) & set(_statistics(term))
        for node in downstream:
            _count_the_batch(gm, node, dp)
            meta.set_placement(node, AXIS, R)
        _share_of_the_loss(gm.graph, term, dp)
    return gm


def _terms(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get(STATISTICS)]


def _statistics(term: fx.Node) -> list[fx.Node]:
    """The term and the values it is made of back to the rank's tokens: tensors without a
    batch dim (not Shard on dp), reached from the term through such values only (a count the
    model's own layers reduce and spread over the tokens again is not one)."""
    found, stack = {term: None}, [term]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in found and _tensor(source) and not isinstance(meta.placement(source, AXIS), Shard):
                found[source] = None
                stack.append(source)
    return list(found)


def _token_reductions(term: fx.Node) -> list[fx.Node]:
    """The term's statistics that reduce the rank's tokens: computed from a Shard value."""
    return [n for n in _statistics(term)
            if any(_tensor(s) and isinstance(meta.placement(s, AXIS), Shard) for s in n.all_input_nodes)]


def _tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def refuse_batch_pieces(term: fx.Node, *, microbatches: int, pp: int, cp: int) -> None:
    """PlanError for a plan that would compute the loss's statistics `term` per piece of the
    batch (module doc): before any pass runs, whose own refusal would say less."""
    split = {"microbatches": microbatches, "pp": pp, "cp": cp}
    field = next((name for name, degree in split.items() if degree > 1), None)
    if field is not None:
        key = "mb" if field == "microbatches" else field
        raise PlanError(
            f"plan {key}={split[field]}: the loss adds a term of the whole batch's statistics to "
            f"the cross entropy ({term.name}, in module {meta.module_path(term)!r}: a router's "
            "load-balancing loss), which each microbatch, stage's pass or sequence slice would "
            "compute from its own piece, not as one device does. Fix: mb=1, pp=1 and cp=1 (dp, "
            "ep and tp compute it exactly), or leave the term out of the loss "
            "(output_router_logits=False)",
            field=field, value=split[field])


def _all_reduced(graph: fx.Graph, node: fx.Node, dp: int) -> fx.Node:
    """`node`'s value over the global batch in its place: summed over dp, or a mean averaged."""
    if node.target not in _SUMS | _MEANS:
        raise PlanError(
            f"the loss's term of batch statistics reduces the rank's tokens at {node.name} "
            f"({node.target}, in module {meta.module_path(node)!r}), which fxpar can make the whole "
            "batch's only for a sum, a histogram or a mean. Fix: dp=1, or leave the term out of the loss",
            field="dp", value=dp)
    if node.target in _MEANS:
        return _mean_of_the_batch(graph, node, dp)
    users = list(node.users)
    total = _insert(graph, fxpar_ops.all_reduce.default, (node, AXIS), node.next, like=node)
    for user in users:
        user.replace_input_with(node, total)
    return total


def _mean_of_the_batch(graph: fx.Graph, mean: fx.Node, dp: int) -> fx.Node:
    """The mean node made the batch's mean: the rank's sum (a summand of the batch's, `Partial`)
    all-reduced, over the rank's count times dp. The node keeps its name and its meaning."""
    summed = _insert(graph, aten.sum.default if mean.target is aten.mean.default else aten.sum.dim_IntList,
                     mean.args, mean, like=mean, kwargs=dict(mean.kwargs))
    meta.set_placement(summed, AXIS, Partial())
    total = _insert(graph, fxpar_ops.all_reduce.default, (summed, AXIS), mean, like=mean)
    count = _scalar(graph, aten.sym_numel.default, (mean.args[0],), mean)
    if mean.target is not aten.mean.default:  # over some dims: the elements per result
        count = _scalar(graph, operator.floordiv, (count, _scalar(graph, aten.sym_numel.default, (summed,), mean)),
                        mean)
    mean.target, mean.args, mean.kwargs = aten.div.Tensor, (total, _scalar(graph, operator.mul, (count, dp), mean)), {}
    meta.set_placement(mean, AXIS, R)
    return mean


def _scalar(graph: fx.Graph, target, args: tuple, before: fx.Node) -> fx.Node:
    """A size computed from sizes (a SymInt node)."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
    return node


def _count_the_batch(gm: fx.GraphModule, node: fx.Node, dp: int) -> None:
    """A division (or product) of global statistics by a count made from the rank's batch size
    takes the global batch's count."""
    if node.op != "call_function" or node.target not in _SCALED:
        return
    batch = gm.meta.get(meta.GRAPH_BATCH, frozenset())
    for scalar in node.args[1:]:
        size = scalar.meta.get("val") if isinstance(scalar, fx.Node) else None
        if isinstance(size, (torch.SymInt, torch.SymFloat)) and size.node.expr.free_symbols & batch:
            with gm.graph.inserting_before(node):
                whole = gm.graph.call_function(operator.mul, (scalar, dp))
            whole.meta["val"] = size * dp
            node.replace_input_with(scalar, whole)


def _share_of_the_loss(graph: fx.Graph, term: fx.Node, dp: int) -> None:
    """The term's value divided by dp in the loss, its gradient whole (module doc)."""
    users = [u for u in term.users if u.op != "output"]
    kept = _insert(graph, aten.detach.default, (term,), term.next, like=term, grad=False)
    scaled = _insert(graph, aten.mul.Tensor, (kept, (dp - 1) / dp), kept.next, like=term, grad=False)
    share = _insert(graph, aten.sub.Tensor, (term, scaled), scaled.next, like=term)
    meta.set_placement(share, AXIS, Partial())
    for user in users:
        user.replace_input_with(term, share)


def _insert(graph: fx.Graph, target, args: tuple, before: fx.Node, *, like: fx.Node, grad: bool | None = None,
            kwargs: dict | None = None) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs or {})
    value = lambda n: n.meta["val"]  # noqa: E731
    node.meta["val"] = target(*fx.node.map_arg(args, value), **fx.node.map_arg(kwargs or {}, value))
    node.meta[meta.MODULE_PATH] = meta.module_path(like)
    node.meta[meta.REQUIRES_GRAD] = meta.requires_grad(like) if grad is None else grad
    node.meta[meta.PLACEMENT] = meta.placements(like)
    meta.set_placement(node, AXIS, R)
    return node
