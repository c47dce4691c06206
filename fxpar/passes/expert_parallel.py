"""Expert parallelism: each mixture-of-experts layer's experts split over the ep ranks.

A Hugging Face MoE layer (transformers 5: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3) routes
each token to its top-k experts, sorts the (token, expert) pairs by expert, counts them per
expert, and runs every expert at once as a grouped matmul over the 3D expert weights, a group
of rows per expert (`transformers.grouped_mm_fallback`, or `aten._grouped_mm`):

    %ids, %order = sort(%expert_ids)                         S = tokens x top-k pairs
    %rows        = %hidden[%order // k]                      (S, H), sorted by expert
    %offsets     = cumsum(histc(%ids, E))                    where each expert's rows end
    %h           = grouped_mm(%rows, %w_in.T, %offsets)      (S, 2I)   w_in: (E, 2I, H)
    ...            silu(gate) * up
    %y           = grouped_mm(%h', %w_out.T, %offsets)       (S, H)
    ...            weighted by the router, back in token order, summed over k

Under `ep=n` the n ranks of an expert group (carved from dp: `ir.mesh`) each hold E/n of the
experts (their weights `ep=S(0)`) and their own slice of the batch. Tokens reach the experts
by one of Megatron-Core's two token dispatchers (the plan's `dispatch`).

**All-to-all** (the default; Megatron-Core's `MoEAlltoAllTokenDispatcher`, DeepSpeed-MoE):
each rank's rows, sorted by expert already, are in blocks by the rank that holds their
expert. The counts per expert are exchanged, the rows sent to their experts' ranks, put in
order by expert, computed, and sent back (`ops.token_dispatch`):

    %counts   = histc(%ids, E) as int64                       rows per expert, this rank's
    %received = all_to_all(%counts, 'ep', n, 0)               [j, e]: rank j's rows for my expert e
    %arrived  = all_to_all_rows(%rows, %counts[by rank], %received[by rank], 'ep', n)
    %order    = expert_order(%received, E/n, rows(%arrived))  by expert, stably by rank
    %offsets  = cumsum(%received summed over ranks)           the rank's own experts' groups
    %h        = grouped_mm(%arrived[%order], %w_in_local.T, %offsets)
    ...
    %y        = all_to_all_rows(grouped_mm(...)[argsort(%order)], received, sent, 'ep', n)

Each row moves once each way and nothing is dropped: a rank computes exactly the rows routed
to its experts, each with the weights one device uses. The rows it receives are known only
when the router has run: the graph's values are sized for uniform routing (as many rows come
as go), the estimate and the prediction of the routed calls with them, and the routed calls
are matched without their size (`ir.collectives.Collective.routed`).

**All-gather** (`dispatch=allgather`; Megatron-Core's `MoEAllGatherTokenDispatcher`): the
group's tokens and their rows' expert ids are all-gathered, each rank runs its own experts on
the rows routed to them, and the results are reduce-scattered back to the ranks the tokens came
from. Every shape stays static, so the collectives, their sizes and the memory are known
before anything runs, at the price of every token on every rank of the group:

    %all     = gather_to_region(%hidden, 'ep', n, 0)         (nT, H): the group's tokens
    %picks   = all_gather(group_rows(%order // k, 'ep', T), 'ep', n, 0)   each row's token in %all
    %keys    = local_experts(all_gather(%ids, 'ep', n, 0), 'ep', E)
    %kept, %mine = sort(%keys, stable=True)                  this rank's rows first, by expert
    %offsets = cumsum(one_hot(%kept)[:, :E/n].sum(0))        the rank's own experts' groups
    %h       = grouped_mm(where(%kept < E/n, %all[%picks[%mine]], 0), %w_in_local.T, %offsets)
    ...
    %y_all   = where(%kept < E/n, grouped_mm(...), 0)[argsort(%mine)]
    %y       = reduce_scatter(%y_all, 'ep', n, 0)            (S, H): each token's sum

Each token is gathered once (the rows a router picks from it, k of them, are picked again
from the gathered tokens; rows made otherwise are gathered as they are). Every row is
computed by exactly one rank, the others add zeros, so the sum is the one device's value bit
for bit. The `where`s keep rows no expert of this rank computed at zero in both directions (a
grouped matmul may leave them unwritten).

Either way, an expert's gradient sums the contributions of the whole expert group's tokens, so
it is complete on the rank up to the other expert groups: a partial sum over edp (`fxpar.grad_partial`),
reduced over the ranks that hold the same experts instead of in dp's buckets.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.graph_paths import ancestors, descendants
from fxpar.ir.placement import Shard
from fxpar.ops.expert_routing import is_grouped_mm
from fxpar.passes.contracts import broken, ensures
from fxpar.passes.expert_bmm import is_expert_bmm, split_bmm_experts

aten, fxpar_ops = torch.ops.aten, torch.ops.fxpar
AXIS = "ep"
_VIEWS = {aten.transpose.int, aten.alias.default}  # views that keep the experts' dim 0 (module doc)
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}


def _offsets(node: fx.Node) -> fx.Node:
    return node.args[2] if len(node.args) > 2 else node.kwargs["offs"]


def experts_split(gm: fx.GraphModule) -> None:
    """Ensures: every grouped matmul reads expert weights split on ep, and its offsets are
    counted from this rank's experts: the counts the ranks sent it (`fxpar.all_to_all`), or
    the keys of the gathered rows (`fxpar.local_experts`)."""
    local = {fxpar_ops.all_to_all.default, fxpar_ops.local_experts.default}
    for node in gm.graph.nodes:
        if is_expert_bmm(node) and not isinstance(meta.placement(node.args[1], AXIS), Shard):
            raise broken("a batched expert matmul's weights are Shard(0) on ep", node)
        if is_grouped_mm(node):
            if not isinstance(meta.placement(_weight(node), AXIS), Shard):
                raise broken("a grouped matmul's expert weights are Shard(0) on ep", node)
            if not any(n.target in local for n in ancestors(_offsets(node))):
                raise broken("a grouped matmul groups its rows by this rank's experts", node)


@ensures(experts_split)
def split_experts(gm: fx.GraphModule, *, ep: int, dispatch: str = "alltoall") -> fx.GraphModule:
    """Split every mixture-of-experts layer's experts over the ep ranks (module doc).

    Requires: the captured graph's `val` on every node.
    Ensures: each grouped matmul computes this rank's experts on the rows the expert group
    routed to them (sent by all-to-all, or picked from the gathered tokens: `dispatch`);
    expert weights are `Shard(0)` on ep and their gradients `fxpar.grad_partial` over edp;
    the layer's output is each rank's own rows' again (sent back, or reduce-scattered)."""
    if not meta.graph_loss(gm).sums:
        raise PlanError(
            f"plan ep={ep} needs the loss as a sum over the step's valid targets (a cross "
            "entropy or NLL loss, mean or sum), and this model's loss is some other mean: an "
            "expert's gradient sums every rank's tokens, which only a sum over the batch "
            "weighs as one device does. Fix: return F.cross_entropy(...) as the loss, or ep=1",
            field="ep", value=ep)
    layers: dict[fx.Node, list[fx.Node]] = {}
    dense: dict[str, list[fx.Node]] = {}  # experts that multiply every token, by module (Llama 4)
    for node in gm.graph.nodes:
        if is_grouped_mm(node):
            layers.setdefault(_offsets(node), []).append(node)
        elif is_expert_bmm(node):
            dense.setdefault(meta.module_path(node), []).append(node)
    if not layers and not dense:
        raise PlanError(
            f"plan ep={ep} splits the experts of mixture-of-experts layers, and this model has "
            "none that fxpar can see: no grouped matmul over 3D expert weights (transformers' "
            "grouped_mm, as Mixtral, Qwen-MoE, OLMoE and DeepSeek-V3 run their experts), nor a "
            "batched one (Llama 4's). Fix: ep=1, and spend these ranks on dp",
            field="ep", value=ep)
    for offsets, matmuls in layers.items():
        _ExpertLayer(gm.graph, offsets, matmuls, ep).split(dispatch)
    for matmuls in dense.values():
        split_bmm_experts(gm.graph, matmuls, ep)
    return gm


class _ExpertLayer:
    """One MoE layer's grouped matmuls (those sharing one offsets node), rewritten in place."""

    def __init__(self, graph: fx.Graph, offsets: fx.Node, matmuls: list[fx.Node], ep: int):
        self.graph, self.offsets, self.matmuls, self.ep = graph, offsets, matmuls, ep
        self.experts = int(offsets.meta["val"].shape[0])
        self.where = meta.module_path(matmuls[0])
        if self.experts % ep:
            raise PlanError(
                f"plan ep={ep}: the mixture of experts at {self.where!r} has {self.experts} "
                f"experts, which do not split over {ep} ranks. Fix: ep dividing {self.experts} "
                f"(for example ep={max(d for d in range(1, ep + 1) if self.experts % d == 0)}), or ep=1",
                field="ep", value=ep)
        self.local = self.experts // ep
        downstream = {m: descendants(m) for m in matmuls}
        self.entries = [m for m in matmuls if not any(m in downstream[o] for o in matmuls if o is not m)]
        self.exits = [m for m in matmuls if not any(o in downstream[m] for o in matmuls if o is not m)]
        feeding_exits = set().union(*(ancestors(e) for e in self.exits))
        self.region = {n for m in self.entries for n in downstream[m] if n in feeding_exits}

    def split(self, dispatch: str) -> None:
        self._check_region_reads_only_rows()
        first = min(self.entries, key=list(self.graph.nodes).index)
        for matmul in self.matmuls:
            self._split_weight(matmul)
        if dispatch == "alltoall":
            self._dispatch_by_all_to_all(first)
        else:
            self._dispatch_by_all_gather(first)

    def _dispatch_by_all_to_all(self, first: fx.Node) -> None:
        """Each row sent to the rank of its expert and back (`ops.token_dispatch`): the
        counts exchanged, the rows moved in blocks of them, put in order by expert for the
        grouped matmuls, and their results moved back to the rows' ranks in the order they
        were sent (module doc)."""
        counts = self._insert(aten._to_copy.default, (self._histogram(),), first, kwargs={"dtype": torch.int64},
                              like=self.offsets)
        received = self._insert(fxpar_ops.all_to_all.default, (counts, AXIS, self.ep, 0), first, like=counts)
        by_rank = [self._insert(aten.view.default, (c, [self.ep, self.local]), first, like=c) for c in (counts, received)]
        sent, got = (self._insert(aten.sum.dim_IntList, (c, [1]), first, like=counts) for c in by_rank)
        per_expert = self._insert(aten.sum.dim_IntList, (by_rank[1], [0]), first, like=counts)
        offsets = self._insert(aten.cumsum.default, (per_expert, 0), first, like=counts,
                               kwargs={"dtype": self.offsets.meta["val"].dtype})
        order, moved = None, {}
        for matmul in self.entries:
            rows = matmul.args[0]
            if rows not in moved:
                arrived = self._insert(fxpar_ops.all_to_all_rows.default, (rows, sent, got, AXIS, self.ep), first,
                                       like=rows)
                if order is None:
                    count = self._insert(aten.sym_size.int, (arrived, 0), first)
                    order = self._insert(fxpar_ops.expert_order.default, (received, self.local, count), first,
                                         like=counts)
                moved[rows] = self._insert(aten.index.Tensor, (arrived, [order]), first, like=rows)
            matmul.replace_input_with(rows, moved[rows])
        for matmul in self.matmuls:
            matmul.replace_input_with(self.offsets, offsets)
        back = self._insert(operator.getitem, (self._insert(aten.sort.default, (order,), first, like=order), 1), first,
                            like=order)
        for matmul in self.exits:
            users, after = list(matmul.users), matmul.next
            sent_order = self._insert(aten.index.Tensor, (matmul, [back]), after, like=matmul)
            returned = self._insert(fxpar_ops.all_to_all_rows.default, (sent_order, got, sent, AXIS, self.ep), after,
                                    like=matmul)
            for user in users:
                user.replace_input_with(matmul, returned)

    def _dispatch_by_all_gather(self, first: fx.Node) -> None:
        """The expert group's tokens gathered, this rank's experts run on the rows routed to
        them, the results reduce-scattered back (module doc)."""
        valid, mine, offsets = self._route(first)
        gathered: dict[fx.Node, fx.Node] = {}
        for matmul in self.entries:
            rows = matmul.args[0]
            if rows not in gathered:
                picked = self._gathered_rows(rows, mine, first)
                gathered[rows] = self._insert(aten.where.ScalarOther, (valid, picked, 0.0), first, like=rows)
            matmul.replace_input_with(rows, gathered[rows])
        for rows in gathered:
            _erase_unused(rows)
        for matmul in self.matmuls:
            matmul.replace_input_with(self.offsets, offsets)
        self._resize_region()
        back = self._insert(operator.getitem, (self._insert(aten.sort.default, (mine,), first, like=mine), 1), first,
                            like=mine)
        for matmul in self.exits:
            self._combine(matmul, valid, back)

    def _gathered_rows(self, rows: fx.Node, mine: fx.Node, before: fx.Node) -> fx.Node:
        """The expert group's rows in the order `mine` sorts them. Rows picked from the tokens
        by index (`hidden[order // k]`: each token once per expert it chose), then cast, are
        picked from the group's gathered tokens instead: k times fewer bytes gathered, and
        their gradients summed over a token's picks before they are reduce-scattered."""
        casts, node = [], rows
        while node.op == "call_function" and node.target in _CASTS:
            casts.append(node)
            node = node.args[0]
        if not (node.target is aten.index.Tensor and len(node.args[1]) == 1 and node.meta["val"].dim() == 2):
            everyone = self._insert(fxpar_ops.gather_to_region.default, (rows, AXIS, self.ep, 0), before, like=rows)
            return self._insert(aten.index.Tensor, (everyone, [mine]), before, like=rows)
        tokens, (index,) = node.args
        count = self._insert(aten.sym_size.int, (tokens, 0), before)
        ours = self._insert(fxpar_ops.group_rows.default, (index, AXIS, count), before, like=index)
        indices = self._insert(fxpar_ops.all_gather.default, (ours, AXIS, self.ep, 0), before, like=index)
        everyone = self._insert(fxpar_ops.gather_to_region.default, (tokens, AXIS, self.ep, 0), before, like=tokens)
        picked = self._insert(aten.index.Tensor, (everyone, [self._insert(aten.index.Tensor, (indices, [mine]), before,
                                                                          like=index)]), before, like=node)
        for cast in reversed(casts):
            picked = self._insert(cast.target, (picked, *cast.args[1:]), before, kwargs=dict(cast.kwargs), like=cast)
        return picked

    def _route(self, before: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
        """Which of the expert group's gathered rows this rank's experts take, inserted before
        `before`: (a column of whether each sorted row is this rank's, the order that sorts
        the gathered rows this rank's first and by expert, the offsets of its experts' rows)."""
        ids = self._expert_ids()

        def insert(target, *args, **kwargs):  # laid out as the ids are, one entry a row
            return self._insert(target, args, before, kwargs=kwargs, like=ids)

        gathered = insert(fxpar_ops.all_gather.default, ids, AXIS, self.ep, 0)
        ordered = insert(aten.sort.stable, insert(fxpar_ops.local_experts.default, gathered, AXIS, self.experts),
                         stable=True)
        kept, mine = insert(operator.getitem, ordered, 0), insert(operator.getitem, ordered, 1)
        valid = insert(aten.unsqueeze.default, insert(aten.lt.Scalar, kept, self.local), -1)
        counts = self._insert(aten.sum.dim_IntList, (insert(aten.one_hot.default, kept, self.local + 1), [0]), before)
        offsets = self._insert(aten.cumsum.default, (self._insert(aten.slice.Tensor, (counts, 0, 0, self.local), before), 0),
                               before, kwargs={"dtype": self.offsets.meta["val"].dtype})
        return valid, mine, offsets

    def _combine(self, matmul: fx.Node, valid: fx.Node, back: fx.Node) -> None:
        """The rank's results (zero where another rank's experts computed) back in the
        group's gathered order, then summed over ep into each rank's own rows."""
        users = list(matmul.users)
        after = matmul.next
        kept = self._insert(aten.where.ScalarOther, (valid, matmul, 0.0), after, like=matmul)
        ordered = self._insert(aten.index.Tensor, (kept, [back]), after, like=matmul)
        mine = self._insert(fxpar_ops.reduce_scatter.default, (ordered, AXIS, self.ep, 0), after, like=matmul)
        for user in users:
            user.replace_input_with(matmul, mine)

    def _split_weight(self, matmul: fx.Node) -> None:
        """The expert weights, and the views between them and the matmul, Shard(0) on ep; the
        parameter's gradient partial over edp."""
        *views, weight = _weight_path(matmul)
        if weight.op != "get_attr" or meta.parameter_name(weight) is None or weight.meta["val"].dim() != 3:
            raise self._refusal(matmul, f"its weights ({weight.name}) are not a 3D parameter of {self.experts} experts")
        for node in (*views, weight):
            meta.set_placement(node, AXIS, Shard(0))
        if meta.requires_grad(weight) and "edp" not in weight.meta.get(meta.GRAD_PARTIAL, ()):
            meta.mark_gradient_partial(weight, "edp")

    def _expert_ids(self) -> fx.Node:
        """The sorted expert ids the layer's offsets count (`cumsum(histc(ids))`)."""
        return self._histogram().args[0]

    def _histogram(self) -> fx.Node:
        """The count of rows per expert the layer's offsets sum (`cumsum(histc(ids))`)."""
        node = self.offsets
        for _ in range(4):
            if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
                break
            if node.target is aten.histc.default:
                return node
            node = node.args[0]
        raise self._refusal(self.matmuls[0], "its offsets are not a histogram (histc) of the sorted expert ids")

    def _check_region_reads_only_rows(self) -> None:
        """Between the grouped matmuls only the rows' own math may run (the activation, the
        gate times up): a value read per row from outside (an expert bias picked by the
        sorted ids) would not follow the rows to the rank that computes them."""
        allowed = {*self.region, *self.matmuls, self.offsets}
        for node in self.region:
            for source in node.all_input_nodes:
                if source not in allowed and not (node in self.matmuls and source is node.args[1]):
                    raise self._refusal(node, f"it reads {source.name}, a value from outside the experts' rows")

    def _resize_region(self) -> None:
        """The values between the matmuls now hold the group's rows: their `val`s again."""
        for node in self.graph.nodes:
            if node in self.region or node in self.matmuls:
                args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
                if is_grouped_mm(node):
                    node.meta["val"] = args[0].new_empty((args[0].shape[0], node.meta["val"].shape[-1]))
                else:
                    node.meta["val"] = node.target(*args, **fx.node.map_arg(node.kwargs, lambda n: n.meta["val"]))

    def _insert(self, target, args: tuple, before: fx.Node, *, like: fx.Node | None = None,
                kwargs: dict | None = None) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs or {})
        value = lambda n: n.meta["val"]  # noqa: E731
        node.meta["val"] = target(*fx.node.map_arg(args, value), **fx.node.map_arg(kwargs or {}, value))
        node.meta[meta.MODULE_PATH] = self.where
        node.meta[meta.REQUIRES_GRAD] = like is not None and meta.requires_grad(like)
        if like is not None and meta.PLACEMENT in like.meta:
            node.meta[meta.PLACEMENT] = meta.placements(like)
        return node

    def _refusal(self, node: fx.Node, why: str) -> PlanError:
        return PlanError(
            f"plan ep={self.ep}: the mixture of experts at {self.where!r} cannot be split over "
            f"ep ranks at {node.name} ({node.target}): {why}. Fix: ep=1 for this model",
            field="ep", value=self.ep)


def _erase_unused(node: fx.Node) -> None:
    """Erase `node` and what made it where nothing else reads them (their metadata asserts
    aside): the rows a rewrite no longer reads."""
    asserts = [u for u in node.users if u.target is aten._assert_tensor_metadata.default]
    if node.op != "call_function" or len(node.users) != len(asserts):
        return
    sources = node.all_input_nodes
    for check in asserts:
        node.graph.erase_node(check)
    node.graph.erase_node(node)
    for source in sources:
        _erase_unused(source)


def _weight_path(matmul: fx.Node) -> list[fx.Node]:
    """The views from a grouped matmul's weight operand back to what they view (the
    parameter, last); a view that moves the experts' dim 0 ends the path."""
    path, node = [], matmul.args[1]
    while node.op == "call_function" and node.target in _VIEWS and 0 not in node.args[1:]:
        path.append(node)
        node = node.args[0]
    return [*path, node]


def _weight(matmul: fx.Node) -> fx.Node:
    return _weight_path(matmul)[-1]
