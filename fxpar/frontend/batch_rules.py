"""What a step's batch must be, read once off the captured graph: the rules `runner.step` checks.

A compiled program runs any batch of the example's form: the same inputs, each of the same
rank, dtype and fixed sizes, its symbolic dims (`batch`, `seq`) of any size. Some batches of
that form still break the step, deep inside torch or, worse, silently:

* a label outside the vocabulary: on one device and under dp, torch's cross entropy raises
  an IndexError from its kernel (a device-side assert on CUDA); under tp the
  vocabulary-parallel cross entropy (`passes.tensor_parallel.vocab_loss`) finds the label on no rank's
  shard and trains on a finite, wrong loss;
* a sequence longer than a position table: `wpe(arange(T))` reads row T-1 of a table of
  `block_size` rows (an IndexError in `torch.embedding`).

Neither limit is in export's range constraints (it keeps `seq` in [2, oo)), so `batch_rules`
reads them off the graph and records them as data (`BatchRules`); the runtime checks a
step against them before it issues a collective (`runtime.step.batch_checks`). The graph is the
capture's (`CapturedGraph.graph_module`, before any pass): the logits have the global
vocabulary there, whatever tp later shards, so one set of rules holds under every plan.

    GPT (examples/gpt.py), vocabulary 64, block_size 16:
        %idx : placeholder                                   -> input 0: int64 (batch, seq)
        %targets : placeholder                               -> input 1: int64 (batch, seq)
        %arange = arange(seq)
        %embedding_1 = embedding(%wpe_weight [16, 32], %arange)  -> seq <= 16
        %view_9 = reshape(%targets, [batch*seq])
        %cross_entropy_loss = cross_entropy_loss(%view_8 [batch*seq, 64], %view_9)
                                                             -> targets in [0, 64) or -100

A loss's target is traced back to a step input through ops that move labels without changing
their values (`_CARRIERS`: views, slices, Hugging Face's shift-and-pad, dtype casts); a target
computed some other way (`labels - 1`, `where(...)`) gives no rule, and the loss checks it as
torch does.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from fxpar.frontend.trace import CapturedGraph
from fxpar.ir import meta

aten = torch.ops.aten
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}
_IGNORE_INDEX = -100  # torch's default ignore_index, argument 4 of every loss above
# Ops whose output holds (some of) their first argument's values unchanged: what a target is
# traced back through. `pad` adds the model's own constant (Hugging Face's -100), not a label.
_CARRIERS = {
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.slice.Tensor,
    aten.select.int, aten.narrow.default, aten.contiguous.default, aten.clone.default,
    aten.detach.default, aten.alias.default, aten.flatten.using_ints, aten.unflatten.int,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default,
    aten.pad.default, aten.constant_pad_nd.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten._to_copy.default, aten.lift_fresh_copy.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
    operator.getitem,
}
_EMBEDDINGS = {aten.embedding.default: (0, 1), aten.index_select.default: (0, 2)}  # (table, index)


@dataclass(frozen=True, kw_only=True)
class InputRule:
    """One step input as the example gave it: `sizes` holds each dim's fixed size, or the
    name of its symbol ("batch", "seq") where export left it free."""

    position: int
    name: str  # the forward parameter the graph's placeholder is named after
    keyword: bool  # given by keyword (the step names it `name`) or by position (`input i`)
    dtype: torch.dtype
    sizes: tuple[int | str, ...]

    @property
    def label(self) -> str:
        """How messages name the input: as the example gave it."""
        return self.name if self.keyword else f"input {self.position} ({self.name})"


@dataclass(frozen=True, kw_only=True)
class LabelRule:
    """Every value of input `position` is a class of the loss's `vocabulary` or its
    `ignore_index`; `loss` says where the rule comes from (the loss node and its module)."""

    position: int
    vocabulary: int
    ignore_index: int
    loss: str


@dataclass(frozen=True, kw_only=True)
class SizeBound:
    """Symbol `symbol` ("seq") is at most `most`; `reason` names the table that bounds it."""

    symbol: str
    most: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class BatchRules:
    """What `runner.step` checks of a batch (`runtime.step.batch_checks`), from `batch_rules`."""

    inputs: tuple[InputRule, ...]
    labels: tuple[LabelRule, ...] = ()
    bounds: tuple[SizeBound, ...] = ()


def batch_rules(captured: CapturedGraph) -> BatchRules:
    """The rules of `captured`'s inputs, labels and symbol bounds (module doc); a walk over
    the graph's nodes, once per runner."""
    graph = captured.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = tuple(
        InputRule(position=i, name=node.name, keyword=captured.keyword_inputs, dtype=node.meta["val"].dtype,
                  sizes=tuple(int(d) if d.is_Integer else str(d) for d in captured.shape(node)))
        for i, node in enumerate(placeholders)
    )
    labels = {rule for node in graph.nodes if node.target in _LOSSES
              if (rule := _label_rule(node, placeholders)) is not None}
    bounds = {bound for node in graph.nodes if node.target in _EMBEDDINGS
              if (bound := _position_bound(captured, node)) is not None}
    return BatchRules(inputs=inputs, labels=tuple(sorted(labels, key=lambda r: (r.position, r.loss))),
                      bounds=tuple(sorted(bounds, key=lambda b: (b.symbol, b.most))))


def _label_rule(loss: fx.Node, placeholders: list[fx.Node]) -> LabelRule | None:
    """The rule of `loss`'s target, when it is a step input carried (`_CARRIERS`) that holds
    class indices (a float target holds class probabilities: no rule)."""
    logits, target = loss.args[0], loss.args[1]
    source = _carried_from(target, lambda n: n in placeholders)
    shape = logits.meta["val"].shape
    classes = shape[1] if len(shape) > 1 else shape[0]  # (N, C, ...) or (C,)
    if source is None or not isinstance(classes, int) or target.meta["val"].is_floating_point():
        return None
    ignore_index = loss.args[4] if len(loss.args) > 4 else loss.kwargs.get("ignore_index", _IGNORE_INDEX)
    return LabelRule(position=placeholders.index(source), vocabulary=classes, ignore_index=int(ignore_index),
                     loss=f"{loss.name} in module {meta.module_path(loss) or '<root module>'!r}")


def _position_bound(captured: CapturedGraph, lookup: fx.Node) -> SizeBound | None:
    """`seq <= n - k` for a table of n rows read at `arange(seq) + k` (a learned position
    embedding: nanoGPT's `wpe(arange(T))`; Hugging Face's `arange(past, past + T)` with no
    past is exported as `arange(T) + 0`)."""
    table_at, index_at = _EMBEDDINGS[lookup.target]
    table, index = lookup.args[table_at], lookup.args[index_at]
    arange, offset = _arange_read(index)
    if arange is None or table.op != "get_attr" or not _counts_from_zero(arange):
        return None
    symbol = captured.readable(arange.meta["val"].shape[0])
    rows = table.meta["val"].shape[0]
    if not isinstance(symbol, sympy.Symbol) or not isinstance(rows, int):
        return None
    read = f"arange({symbol})" + (f" + {offset}" if offset else "")
    return SizeBound(symbol=symbol.name, most=rows - offset,
                     reason=f"{table.target} has {rows} rows, read at {read} by {lookup.name} "
                            f"in module {meta.module_path(lookup) or '<root module>'!r}")


def _counts_from_zero(arange: fx.Node) -> bool:
    """`arange(end)` or `arange(0, end)`, step 1: it reads rows 0 to end - 1."""
    start = arange.args[0] if arange.target is aten.arange.start else 0
    return start == 0


def _arange_read(index: fx.Node) -> tuple[fx.Node | None, int]:
    """The `arange` whose values `index` carries (`_CARRIERS`), and the constant added to them."""
    offset = 0
    while isinstance(index, fx.Node):
        if index.target in (aten.arange.default, aten.arange.start):
            return index, offset
        if index.target in (aten.add.Tensor, aten.add.Scalar) and isinstance(index.args[1], int):
            offset += index.args[1]
        elif index.op != "call_function" or index.target not in _CARRIERS:
            break
        index = index.args[0]
    return None, 0


def _carried_from(node: fx.Node, is_source) -> fx.Node | None:
    """The first node `is_source` accepts up `node`'s chain of `_CARRIERS` (first arguments)."""
    while isinstance(node, fx.Node):
        if is_source(node):
            return node
        if node.op != "call_function" or node.target not in _CARRIERS:
            return None
        node = node.args[0]
    return None
