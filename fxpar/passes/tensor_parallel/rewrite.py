"""Tensor parallelism as a rewrite: placements in, every collective derived.

`shard_tensor_parallel(gm, placements=..., tp=..., sequence_parallel=...)` walks the graph
once, in order. For each op it asks `propagation.RULES` where the op needs its inputs; where
an input lies otherwise it inserts the op that `fxpar.ops.redistribution` names for the move (a
`torch.ops.fxpar` op on mesh axis "tp", whose backward is the dual collective), and it
rewrites what must change for local shards: the constants of views (head counts, hidden
sizes), the split sizes or slice bounds of a fused q|k|v projection, the bias of a
row-parallel projection (added once, after the sum), a vocabulary-parallel embedding and
cross entropy.

One rule needs no op in particular: a replicated input that requires grad and feeds math whose
output is sharded or partial contributes only a partial gradient on each rank, so it passes
through `copy_to_region` (Megatron's f: identity forward, all-reduce backward), once per value.
Megatron's f and g thus fall out of the table instead of being placed by hand.

Some values are converted right where they are produced, for all their uses ("settled"): a
vocabulary-parallel embedding's partial sums (all-reduced at once, so the residual stream stays
replicated and no norm sums them again), and the output of a module whose style is
`colwise_gather_output` (all-gathered, so the rest of the model sees the whole value).

    before (colwise q, rowwise o):          after, on each of tp ranks:
      linear = aten.linear(ln, q_w, q_b)      copy = fxpar.copy_to_region(ln, 'tp')
      view = aten.view(linear, [B, T, 4, 8])  linear = aten.linear(copy, q_w, q_b)   # q_w: S(0)
      ...                                     view = aten.view(linear, [B, T, 2, 8]) # 4 heads / 2
      out = aten.linear(y, o_w, o_b)          out = aten.linear(y, o_w)              # partial
                                              all_reduce = fxpar.all_reduce(out, 'tp') # g
                                              add = aten.add(all_reduce, o_b)

The graph holds no runtime object: the ops name the axis, and `Program.bind()` connects it.

Requires: `fxpar.parameter` on parameter nodes; `placements` for every parameter.
Ensures: `fxpar.ir.placement` on every tensor node, its tp axis set (its global value's layout
across the tp group); the graph computes each rank's local part; the loss is replicated.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import Placement, Placements, R, Replicate, Shard, local_shape
from fxpar.ops.distributed import DistributedOp
from fxpar.ops.redistribution import Unfuse, Via, conversion_dim, converted_placement, redistribution
import fxpar.ops.vocab_parallel  # noqa: F401  (registers torch.ops.fxpar.vocab_parallel_embedding)
from fxpar.passes.contracts import broken, ensures
from fxpar.passes.tensor_parallel.decision import Context, Decision, Rewrite, is_tensor, shape_of
from fxpar.passes.tensor_parallel.projections import packet, projection_of
from fxpar.passes.tensor_parallel.propagation import rule_for
from fxpar.passes.tensor_parallel.view_rules import one_block
from fxpar.passes.tensor_parallel.vocab_loss import vocab_parallel_cross_entropy

AXIS = "tp"  # the mesh axis the inserted ops name
aten = torch.ops.aten


def _order(graph: fx.Graph):
    positions = {n: i for i, n in enumerate(graph.nodes)}
    return positions.__getitem__


def every_tensor_placed(gm: fx.GraphModule) -> None:
    """Ensures: every tensor the graph computes, or reads as a parameter, has a placement."""
    for node in gm.graph.nodes:
        computed = node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
        if (computed or meta.parameter_name(node) is not None) and meta.PLACEMENT not in node.meta:
            raise broken("every tensor node has a placement (fxpar.ir.placement)", node)


@ensures(every_tensor_placed)
def shard_tensor_parallel(
    gm: fx.GraphModule,
    *,
    placements: Mapping[str, Placement],
    tp: int,
    sequence_parallel: bool = False,
    seq: frozenset = frozenset(),
    gathered_outputs: frozenset[str] = frozenset(),
    loss_rows: int | None = None,
) -> fx.GraphModule:
    """Rewrite `gm` so that it computes one tensor-parallel rank's share (see module doc).

    `gathered_outputs` names the modules whose sharded projections and lookups give their
    output whole (style colwise_gather_output), as `rules.parameter_placements` records;
    `loss_rows` (plan loss=chunked) has a vocabulary-parallel loss reduce that many rows at a time.
    """
    graph = gm.graph
    walk = _Walk(graph, Context({}, tp, sequence_parallel, seq), gathered_outputs, loss_rows)
    for node in list(graph.nodes):
        if node.op == "get_attr" and (name := meta.parameter_name(node)) is not None:
            walk.set(node, placements.get(name, R))
        elif node.op == "call_function" and (is_tensor(node) or isinstance(node.meta.get("val"), (list, tuple))):
            walk.visit(node)
        elif node.op == "output":
            loss = node.args[0]
            node.args = (walk.convert(loss, R, before=node),)
    walk.settle_parameters_feeding_shards()
    gm.recompile()
    return gm


def _no_rule(node: fx.Node, inputs: dict) -> PlanError:
    """An op tensor parallelism cannot place, met by a split input: the modules that split its
    inputs are what a user can keep whole."""
    split_by = sorted({meta.module_path(n) for n, p in inputs.items() if not isinstance(p, Replicate)} - {""})
    rules = ", ".join(f"{path!r}: 'replicate'" for path in split_by) or "'<module>': 'replicate'"
    return PlanError(
        f"tensor parallelism has no placement rule for op {node.target} at {meta.describe(node)}; "
        f"its inputs are {', '.join(f'{n.name}: {p}' for n, p in inputs.items())}, split in modules "
        f"{', '.join(map(repr, split_by))}. Fix: keep them whole, tp_rules as a mapping with "
        f"{{{rules}}} beside the rules that split the rest, or spend these ranks on dp or pp",
        field="tp",
    )


class _Walk:
    def __init__(self, graph: fx.Graph, ctx: Context, gathered: frozenset[str], loss_rows: int | None = None):
        self.graph, self.ctx, self.gathered, self.loss_rows = graph, ctx, gathered, loss_rows
        self.converted: dict[tuple[fx.Node, Placement, bool], fx.Node] = {}
        self.sharded_uses: dict[fx.Node, list[fx.Node]] = {}  # parameter -> sharded consumers

    def set(self, node: fx.Node, placement) -> None:
        self.ctx.placements[node] = placement
        if not isinstance(placement, list):  # a tuple of values: each getitem gets its own
            meta.set_placement(node, AXIS, placement)

    def visit(self, node: fx.Node) -> None:
        rule = rule_for(node)
        inputs = {n: self.ctx.placement(n) for n in node.all_input_nodes if is_tensor(n)}
        if rule is None:
            if any(not isinstance(p, Replicate) for p in inputs.values()):
                raise _no_rule(node, inputs)
            decision = Decision(R, inputs)
        else:
            decision = rule(node, self.ctx)
        sharded_output = not isinstance(decision.output, (Replicate, list))
        for source, wanted in decision.inputs.items():
            if (
                sharded_output
                and isinstance(wanted, Replicate)
                and meta.requires_grad(source)
            ):
                if meta.parameter_name(source) is not None:
                    self.sharded_uses.setdefault(source, []).append(node)  # see below
                    continue
                replacement = self.convert(source, wanted, before=node, into_sharded_math=True)
            else:
                replacement = self.convert(source, wanted, before=node)
            if replacement is not source:
                node.replace_input_with(source, replacement)
        if decision.rewrite is not None:
            self.REWRITES[decision.rewrite](self, node, decision)
        self.set(node, decision.output)
        settle_to = decision.settle_to
        if settle_to is None and self._gathers(node, decision.output):
            settle_to = R
        if settle_to is not None:
            self.settle(node, settle_to)

    def _gathers(self, node: fx.Node, output) -> bool:
        """Whether `node` is a sharded projection or lookup of a colwise_gather_output module."""
        looks_up = projection_of(node) is not None or packet(node) is torch.ops.aten.embedding
        return looks_up and isinstance(output, Shard) and meta.module_path(node) in self.gathered

    def settle(self, node: fx.Node, wanted) -> None:
        """Convert `node`'s value to `wanted` right after it is produced, for all its uses."""
        users = list(node.users)
        converted = self.convert(node, wanted, before=node.next)
        converted.meta[meta.MODULE_PATH] = meta.module_path(node)
        for user in users:
            user.replace_input_with(node, converted)

    def settle_parameters_feeding_shards(self) -> None:
        """Replicated parameters in sharded math: one coalesced gradient all-reduce, not f each.

        Under sequence parallelism every norm weight and row-parallel bias meets sequence
        shards; an f per parameter would all-reduce each gradient separately during backward.
        Megatron instead all-reduces such gradients together once backward is done, and so does
        fxpar: a parameter whose every use is sharded math gets `fxpar.grad_partial`, and the
        runtime sums those gradients over the tp group in one call after the last microbatch.
        A parameter also used whole keeps an f on its sharded uses.
        """
        for parameter, consumers in self.sharded_uses.items():
            tensor_users = [u for u in parameter.users if u.op != "output"]
            if len(set(consumers)) == len(tensor_users):
                meta.mark_gradient_partial(parameter, AXIS)
                continue
            first = min(consumers, key=_order(self.graph))
            copy = self.convert(parameter, R, before=first, into_sharded_math=True)
            for consumer in consumers:
                consumer.replace_input_with(parameter, copy)

    # -- redistribution ------------------------------------------------------------------------

    def convert(self, source: fx.Node, wanted: Placement, *, before: fx.Node,
                into_sharded_math: bool = False) -> fx.Node:
        """`source` laid out as `wanted`, through the ops of `fxpar.ops.redistribution`'s table;
        `into_sharded_math`: the consumer's gradient for it is a partial sum (Megatron's f)."""
        have = self.ctx.placement(source)
        if have == wanted and not into_sharded_math:
            return source
        key = (source, wanted, into_sharded_math)
        if key in self.converted:
            return self.converted[key]
        row = redistribution(have, wanted, into_sharded_math)
        if row is None:
            raise PlanError(
                f"tensor parallelism cannot turn {source.name} ({meta.describe(source)}) from {have} "
                f"into {wanted} for {before.format_node()}. Fix: replicate the module that "
                "produces it (tp_rules={'<module>': 'replicate'})",
                field="tp",
            )
        if isinstance(row, Via):
            step = self.convert(source, row.placement, before=before)
            node = self.convert(step, wanted, before=before, into_sharded_math=into_sharded_math)
        elif isinstance(row, Unfuse) and row.equal:
            blocks = self._add(aten.unflatten.int, (source, row.dim, [len(row.widths), -1]), Shard(row.dim + 1),
                               like=source, before=before)
            whole = self.convert(blocks, R, before=before, into_sharded_math=into_sharded_math)
            node = self._add(aten.flatten.using_ints, (whole, row.dim, row.dim + 1), R, like=source, before=before)
        elif isinstance(row, Unfuse):
            node = self._join_blocks(source, row, into_sharded_math, before=before)
        else:
            node = self._insert(row.op, source, conversion_dim(row, have, wanted), before=before)
            self.set(node, converted_placement(row, have, wanted))
        self.converted[key] = node
        return node

    def _insert(self, op: DistributedOp, source: fx.Node, dim: int | None, *, before: fx.Node) -> fx.Node:
        args = (source, AXIS, self.ctx.tp, dim) if op.takes_dim else (source, AXIS)
        with self.graph.inserting_before(before):
            node = self.graph.call_function(op.overload, args)
        node.meta["val"] = source.meta["val"]  # the global value is the same; its layout moved
        node.meta[meta.MODULE_PATH] = meta.module_path(before)
        node.meta[meta.REQUIRES_GRAD] = meta.requires_grad(source)
        return node

    def _join_blocks(self, source: fx.Node, row: Unfuse, into_sharded_math: bool, *, before: fx.Node) -> fx.Node:
        """Unequal blocks made whole: split apart (each rank's slices of each), each moved to
        Replicate, concatenated."""
        sizes = self.ctx.placement(source).block_sizes(int(shape_of(source)[row.dim]))
        split = self._add(aten.split_with_sizes.default, (source, [self._local(b) for b in sizes], row.dim),
                          [Shard(row.dim)] * len(sizes), like=source, before=before,
                          val=aten.split_with_sizes.default(source.meta["val"], sizes, row.dim))
        wholes = [
            self.convert(self._add(operator.getitem, (split, i), Shard(row.dim), like=source, before=before), R,
                         before=before, into_sharded_math=into_sharded_math)
            for i in range(len(sizes))
        ]
        return self._add(aten.cat.default, (wholes, row.dim), R, like=source, before=before)

    def _add(self, target, args: tuple, placement, *, like: fx.Node, before: fx.Node, val=None) -> fx.Node:
        """`target(*args)`, inserted before `before` at `placement`, requiring grad as `like`
        does; its global value `val`, by default computed from its inputs' (a local size in
        `args` would not give it)."""
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args)
        node.meta["val"] = val if val is not None else target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        node.meta[meta.MODULE_PATH] = meta.module_path(before)
        node.meta[meta.REQUIRES_GRAD] = meta.requires_grad(like)
        self.set(node, placement)
        return node

    # -- rewrites of the op itself -------------------------------------------------------------

    def _local_sizes(self, node: fx.Node, decision: Decision) -> None:
        """A view's size constants for the local shard: [B, T, 12, 64] -> [B, T, 6, 64]."""
        index = 2 if node.target.overloadpacket is torch.ops.aten.unflatten else 1
        if len(node.args) <= index or not isinstance(node.args[index], (list, tuple)):
            return
        sizes = list(node.args[index])
        out_dim = decision.output.dim - (len(shape_of(node)) - len(sizes))
        size = sizes[out_dim]
        if isinstance(size, int) and size != -1:
            if size % self.ctx.tp:
                raise PlanError(
                    f"{meta.describe(node)} has size {size} along its sharded dim, not "
                    f"divisible by tp={self.ctx.tp} (for grouped-query attention: the number of "
                    "key/value heads). Fix: choose tp dividing it",
                    field="tp",
                    value=self.ctx.tp,
                )
            sizes[out_dim] = self._local(size)
        elif isinstance(size, fx.Node):
            raise PlanError(
                f"{meta.describe(node)} shards a dim whose size is computed at run time; "
                "fxpar cannot rewrite it. Fix: replicate the module",
                field="tp",
            )
        args = list(node.args)
        args[index] = sizes
        node.args = tuple(args)

    def _local_split(self, node: fx.Node, decision: Decision) -> None:
        """A fused projection's split sizes for the local shard: split(qkv, C) -> split(qkv, C/t).
        chunk(gate_up, 2) names a count of blocks, not a size: it stays."""
        if packet(node) is aten.chunk:
            return
        args = list(node.args)
        sizes = args[1]
        args[1] = [self._local(s) for s in sizes] if isinstance(sizes, (list, tuple)) else self._local(sizes)
        node.args = tuple(args)

    def _local_slice(self, node: fx.Node, decision: Decision) -> None:
        """A slice taking one block of a fused dim, for the local blocks: qkv[..., 64:96] ->
        qkv[..., 32:48] at tp=2 (each rank's blocks lie side by side, each 1/tp of the whole)."""
        start, stop = one_block(node, self.ctx.placement(node.args[0]))
        node.args = (node.args[0], node.args[1], self._local(start), self._local(stop))

    def _local(self, size: int) -> int:
        """One rank's share of a size along a dim split over tp (`placement.local_shape`)."""
        return local_shape((size,), Placements(tp=Shard(0)), {AXIS: self.ctx.tp})[0]

    def _bias_after_reduction(self, node: fx.Node, decision: Decision) -> None:
        """A row-parallel projection's bias, added once after the sum of the partials:

            linear(x, w, b)  ->  linear(x, w) + b
            addmm(b, x, w)   ->  mm(x, w) + b
        """
        projection = projection_of(node)
        bias = projection.bias
        if packet(node) is torch.ops.aten.addmm:
            node.target = torch.ops.aten.mm.default
        node.args, node.kwargs = (projection.x, projection.weight), {}
        with self.graph.inserting_after(node):
            add = self.graph.call_function(torch.ops.aten.add.Tensor, (node, bias))
        add.meta.update({k: v for k, v in node.meta.items() if k != meta.PLACEMENT})
        add.meta[meta.REQUIRES_GRAD] = meta.requires_grad(node) or meta.requires_grad(bias)
        node.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
        self.set(node, decision.output)
        self.visit(add)

    def _vocab_parallel_embedding(self, node: fx.Node, decision: Decision) -> None:
        """embedding(w, ids, padding_idx) on a vocabulary shard (see fxpar.ops.vocab_parallel).

        The padding row keeps a zero gradient, as on one device: the rank holding it skips it.
        Frequency-scaled and sparse gradients are refused: each rank would count only the
        tokens of its own rows, and sparse gradients do not reach the sharded optimizer.
        """
        options = dict(zip(("padding_idx", "scale_grad_by_freq", "sparse"), node.args[2:])) | node.kwargs
        for option in ("scale_grad_by_freq", "sparse"):
            if options.get(option, False):
                raise PlanError(
                    f"a vocabulary-parallel embedding cannot take {option}=True: "
                    f"{meta.describe(node)}. Fix: replicate the embedding "
                    f"(tp_rules={{{_module_of(node.args[0])!r}: 'replicate'}}), or build it "
                    f"without {option}",
                    field="tp_rules",
                )
        weight, indices = node.args[0], node.args[1]
        node.target = torch.ops.fxpar.vocab_parallel_embedding.default
        node.args, node.kwargs = (weight, indices, AXIS, options.get("padding_idx", -1)), {}

    def _vocab_parallel_cross_entropy(self, node: fx.Node, decision: Decision) -> None:
        vocab_parallel_cross_entropy(self.graph, node, axis=AXIS, size=self.ctx.tp, set_placement=self.set,
                                     chunk_rows=self.loss_rows)

    REWRITES = {
        Rewrite.LOCAL_SIZES: _local_sizes,
        Rewrite.LOCAL_SPLIT: _local_split,
        Rewrite.LOCAL_SLICE: _local_slice,
        Rewrite.BIAS_AFTER_REDUCTION: _bias_after_reduction,
        Rewrite.VOCAB_PARALLEL_EMBEDDING: _vocab_parallel_embedding,
        Rewrite.VOCAB_PARALLEL_CROSS_ENTROPY: _vocab_parallel_cross_entropy,
    }


def _module_of(parameter: fx.Node) -> str:
    name = meta.parameter_name(parameter) or meta.module_path(parameter)
    return name.rsplit(".", 1)[0] if "." in name else name
