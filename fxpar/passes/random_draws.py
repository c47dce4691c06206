"""Random ops drawn from streams of their own, chosen by the value's placement.

`draw_from_streams` replaces every random op torch.export captured with an op of
`fxpar.ops.random_ops`, numbered in graph order (one device's order), whose slice arguments say
which mesh axes split the value: its generator's seed follows from the job's seed, the step,
the op and this rank's slice (`fxpar.ops.random_streams`), never from the process.

    before: dropout = torch.ops.aten.dropout.default(add, 0.1, True)
    after:  detach = torch.ops.aten.detach.default(add)
            random_like = torch.ops.fxpar.random_like.default(detach, 'dropout', 0.1, 0, False, 0, 2, 1, -1, 1, 2)
            dropout = torch.ops.aten.mul.Tensor(add, random_like)

    before: sdpa = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, None, 0.1, True)
    after:  mask = torch.ops.fxpar.attention_dropout_mask.default(q, k, 0.1, 1, False, ...)
            sdpa = torch.ops.fxpar.attention_with_dropout_mask.default(q, k, v, None, 0.1, True, mask, None, False)

Captured as                                     becomes
    aten.dropout (train, p > 0)                 x * random_like(x, "dropout", p)
    aten.native_dropout (train)                 (x * that mask, the mask != 0)
    aten.rand_like, aten.randn_like             random_like(x, "uniform" / "normal")
    aten.bernoulli(x), aten.bernoulli.p(x, p)   random_like(x, "bernoulli" / "bernoulli_p")
    aten.rand(size), aten.randn(size), tp=1     random_like(empty(size), "uniform" / "normal")
    scaled_dot_product_attention, dropout_p > 0 attention_with_dropout_mask (torch's math
                                                kernel: no fused kernel takes a mask)

Any other op torch tags `nondeterministic_seeded` (`randint`, `randperm`, `normal`, `rand`
with a size under tp, ...) is refused with a CaptureError naming it and its module: drawn from each
process's own generator it would silently differ across ranks.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.errors import CaptureError
from fxpar.ir import meta
from fxpar.ir.placement import Shard
from fxpar.ops.random_ops import DrawSlice
import fxpar.ops.random_ops  # noqa: F401  (registers torch.ops.fxpar's random ops)
from fxpar.passes.contracts import broken, ensures

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar
_LIKE = {
    aten.rand_like.default: "uniform",
    aten.randn_like.default: "normal",
    aten.bernoulli.default: "bernoulli",
    aten.bernoulli.p: "bernoulli_p",
}
# Draws given a size, not a tensor: their sizes are read from tensors' (`torch.rand(x.shape)`),
# which under tensor parallelism may be a shard's while the draw looks replicated, so they are
# drawn without tp only (rand_like is drawn under every plan).
_SIZED = {aten.rand.default: "uniform", aten.randn.default: "normal"}
DRAWS = (fxpar_ops.random_like.default, fxpar_ops.attention_dropout_mask.default)


def draws_from_streams(gm: fx.GraphModule) -> None:
    """Ensures: no random op is left that draws from the process's generator, and the
    graph's draws are numbered 0, 1, ... in graph order."""
    indices = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in DRAWS:
            indices.append(node.args[3])
        elif _seeded(node):
            raise broken("every random op draws from an fxpar stream", node)
    if indices != list(range(len(indices))):
        raise broken(f"random ops numbered 0.. in graph order, got {indices}")


@ensures(draws_from_streams)
def draw_from_streams(gm: fx.GraphModule, *, exact: bool, dp: int, tp: int, microbatches: int) -> fx.GraphModule:
    """Replace each random op with one drawing from its stream (module doc).

    Requires: placements on every tensor node, both axes (after `place_data_parallel`), and
    the graph not yet cut into stages (the numbering is the whole graph's).
    Ensures: `draws_from_streams`; each new node carries the placements, module path and
    `val` of the value it stands for (the mask: its input's), and needs no gradient.
    """
    drawing = _Drawing(gm.graph, exact=exact, dp=dp, tp=tp, microbatches=microbatches)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.dropout.default:
            p, train = node.args[1], node.args[2]
            if train and p > 0:  # otherwise the identity, drawing nothing
                drawing.dropout(node, p)
        elif node.target is aten.native_dropout.default and node.args[2] is not False:
            drawing.native_dropout(node, node.args[1])
        elif node.target in _LIKE:
            drawing.like(node, _LIKE[node.target])
        elif node.target in _SIZED and tp == 1:
            drawing.sized(node, _SIZED[node.target])
        elif (p := _attention_dropout(node)) is not None:
            drawing.attention(node, p)
        elif _seeded(node):
            path = meta.module_path(node)
            raise CaptureError(
                f"the model draws random values with {node.target} in "
                f"{f'module {path!r}' if path else 'the root module'} ({node.format_node()}), "
                "which fxpar cannot draw per slice yet: each process would draw its own, so "
                "ranks would silently differ. fxpar draws dropout, scaled_dot_product_attention's "
                "dropout, rand_like, randn_like, bernoulli, and rand and randn without tensor "
                "parallelism. Fix: write the draw with one of "
                "those (torch.rand_like(x) for torch.rand(x.shape)), or draw it outside forward "
                "and pass it as an input"
            )
    gm.graph.lint()
    gm.recompile()
    return gm


def _equal_blocks(placement: Shard, node: fx.Node) -> int:
    """The count of a tensor-parallel shard's equal blocks, what a per-slice draw tiles; a
    draw on unequal blocks (a grouped-query q|k|v before its slices) is refused."""
    if isinstance(placement.parts, int):
        return placement.parts
    raise CaptureError(
        f"the model draws random values on {node.format_node()} (module "
        f"{meta.module_path(node)!r}), a value tensor parallelism splits in unequal blocks "
        f"({placement}), which fxpar cannot draw per slice. Fix: draw after the blocks are "
        "sliced apart, or replicate the projection (tp_rules)"
    )


def draws_randomness(gm: fx.GraphModule) -> bool:
    """Whether the captured graph has a random op (what decides that the pass runs)."""
    return any(node.op == "call_function" and _seeded(node) for node in gm.graph.nodes)


def _seeded(node: fx.Node) -> bool:
    """Whether `node` draws from the process's generator: torch tags such ops, and
    scaled_dot_product_attention among them, which draws only with dropout_p > 0."""
    target = node.target
    if target is aten.scaled_dot_product_attention.default:
        return _attention_dropout(node) is not None
    if target is aten.dropout.default:
        return node.args[2] and node.args[1] > 0
    if target is aten.native_dropout.default:
        return node.args[2] is not False
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _attention_dropout(node: fx.Node) -> float | None:
    """dropout_p of a scaled_dot_product_attention that drops out, else None."""
    if node.target is not aten.scaled_dot_product_attention.default:
        return None
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return p if p > 0 else None


class _Drawing:
    def __init__(self, graph: fx.Graph, *, exact: bool, dp: int, tp: int, microbatches: int):
        self.graph, self.exact = graph, exact
        self.dp, self.tp, self.microbatches = dp, tp, microbatches
        self.count = 0

    def slice_of(self, node: fx.Node) -> DrawSlice:
        """How `node`'s value lies across the mesh: the dims its placements shard (a Partial
        or Replicate value is drawn alike on every rank of the axis: the mask of a sum of
        summands is the mask of each)."""
        placements = meta.placements(node)
        dp, tp = placements["dp"], placements["tp"]
        return DrawSlice(
            dp_dim=dp.dim if isinstance(dp, Shard) else -1, dp_size=self.dp, microbatches=self.microbatches,
            tp_dim=tp.dim if isinstance(tp, Shard) else -1,
            tp_parts=_equal_blocks(tp, node) if isinstance(tp, Shard) else 1, tp_size=self.tp,
        )

    def _next(self) -> int:
        self.count += 1
        return self.count - 1

    def _new(self, target, args: tuple, *, like: fx.Node, val, grad: bool, kwargs=None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})
        meta.copy_export_provenance(node, like)
        node.meta[meta.MODULE_PATH] = meta.module_path(like)
        node.meta[meta.PLACEMENT] = meta.placements(like)
        node.meta[meta.REQUIRES_GRAD] = grad
        node.meta["val"] = val
        return node

    def _draw(self, x: fx.Node, distribution: str, p: float, at: fx.Node) -> fx.Node:
        with self.graph.inserting_before(at):
            detached = self._new(aten.detach.default, (x,), like=at, val=x.meta["val"], grad=False)
            detached.meta[meta.PLACEMENT] = meta.placements(x)
            args = (detached, distribution, float(p), self._next(), self.exact, *self.slice_of(x).args)
            return self._new(fxpar_ops.random_like.default, args, like=at, val=x.meta["val"], grad=False)

    def dropout(self, node: fx.Node, p: float) -> None:
        x = node.args[0]
        mask = self._draw(x, "dropout", p, node)
        with self.graph.inserting_before(node):
            product = self._new(aten.mul.Tensor, (x, mask), like=node, val=node.meta["val"],
                                grad=meta.requires_grad(node))
        self._replace(node, product)

    def native_dropout(self, node: fx.Node, p: float) -> None:
        """(x * mask, the kept elements), as `aten.native_dropout` returns them."""
        x = node.args[0]
        mask = self._draw(x, "dropout", p, node)
        out_val, kept_val = node.meta["val"]
        with self.graph.inserting_before(node):
            product = self._new(aten.mul.Tensor, (x, mask), like=node, val=out_val, grad=meta.requires_grad(x))
            product.meta[meta.PLACEMENT] = meta.placements(x)
            kept = self._new(aten.ne.Scalar, (mask, 0), like=node, val=kept_val, grad=False)
            kept.meta[meta.PLACEMENT] = meta.placements(x)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise CaptureError(f"native_dropout's result is used whole by {user.format_node()}")
            self._replace(user, (product, kept)[user.args[1]])
        self.graph.erase_node(node)

    def sized(self, node: fx.Node, distribution: str) -> None:
        """`rand(size)` as `random_like(empty(size))`: the empty tensor lends its shape."""
        options = {k: v for k, v in node.kwargs.items() if k in ("dtype", "layout", "device", "pin_memory")}
        with self.graph.inserting_before(node):
            like = self._new(aten.empty.memory_format, (node.args[0],), kwargs=options, like=node,
                             val=node.meta["val"], grad=False)
        self._replace(node, self._draw(like, distribution, 0.0, node))

    def like(self, node: fx.Node, distribution: str) -> None:
        x = node.args[0]
        p = node.args[1] if distribution == "bernoulli_p" else 0.0
        self._replace(node, self._draw(x, distribution, p, node))

    def attention(self, node: fx.Node, p: float) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        q, k = bound["query"], bound["key"]
        q_val, k_val = q.meta["val"], k.meta["val"]
        with q_val.fake_mode:
            mask_val = q_val.new_empty(fxpar.ops.random_ops.attention_shape(q_val, k_val), dtype=torch.bool)
        args = (q, k, float(p), self._next(), self.exact, *self.slice_of(q).args)
        with self.graph.inserting_before(node):
            mask = self._new(fxpar_ops.attention_dropout_mask.default, args, like=node, val=mask_val, grad=False)
            mask.meta[meta.PLACEMENT] = meta.placements(q)
            attended = self._new(fxpar_ops.attention_with_dropout_mask.default, (
                q, k, bound["value"], bound.get("attn_mask"), float(p), bool(bound.get("is_causal", False)),
                mask, bound.get("scale"), bool(bound.get("enable_gqa", False)),
            ), like=node, val=node.meta["val"], grad=meta.requires_grad(node))
        self._replace(node, attended)

    def _replace(self, node: fx.Node, new: fx.Node) -> None:
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)

