"""`loss=chunked`: the cross entropy over the vocabulary, a block of rows at a time.

Rewrites each whole-vocabulary `aten.cross_entropy_loss` into `torch.ops.fxpar.chunked_cross_entropy`
(`ops.chunked_loss`), which never holds an [N, V] fp32 tensor. Under bf16-mixed the logits reach
the loss through an fp32 copy (`passes.mixed_precision`); the op takes the bf16 logits instead
and widens one block at a time, so the copy goes too:

    before                                             after
      wide = _to_copy(logits, dtype=float32)             (loss, lse) = fxpar.chunked_cross_entropy(
      loss = cross_entropy_loss(wide, target,                 logits, target, -100, 2, rows)
                                None, 2, -100)             total = loss[0]

The loss is one device's up to the order of fp32 sums. The new nodes take the old loss's
metadata (its placements: a replicated scalar), so later passes and lowering read them as
they read the loss. Runs after tensor parallelism, whose vocabulary-parallel rewrite takes
every loss over sharded logits and, under loss=chunked, chunks it itself
(`passes.tensor_parallel.vocab_loss`).

Requires: a graph after `shard_tensor_parallel` (or without tp).
Ensures: no `aten.cross_entropy_loss` without class weights and label smoothing is left.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.ops import chunked_loss
from fxpar.passes.contracts import broken, ensures

aten = torch.ops.aten
_DEFAULTS = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
_NAMES = ("weight", "reduction", "ignore_index", "label_smoothing")


def _options(node: fx.Node) -> dict:
    return _DEFAULTS | dict(zip(_NAMES, node.args[2:])) | node.kwargs


def _chunkable(node: fx.Node) -> bool:
    options = _options(node)
    return (node.op == "call_function" and node.target is aten.cross_entropy_loss.default
            and options["weight"] is None and not options["label_smoothing"] and options["reduction"] in (1, 2)
            and node.args[0].meta["val"].dim() == 2)


def no_whole_vocabulary_loss(gm: fx.GraphModule) -> None:
    """Ensures: every chunkable cross entropy was chunked."""
    for node in gm.graph.nodes:
        if _chunkable(node):
            raise broken("every whole-vocabulary cross entropy runs chunked", node)


@ensures(no_whole_vocabulary_loss)
def chunk_cross_entropy(gm: fx.GraphModule, *, rows: int = chunked_loss.ROWS) -> fx.GraphModule:
    """Rewrite each cross entropy over whole-vocabulary logits as the module doc says."""
    for node in list(gm.graph.nodes):
        if not _chunkable(node):
            continue
        options = _options(node)
        logits, target = node.args[:2]
        widened = logits if widens_only(logits) else None
        if widened is not None:  # bf16-mixed's fp32 copy: the op widens block by block
            logits = widened.args[0]
        with gm.graph.inserting_before(node):
            both = gm.graph.call_function(torch.ops.fxpar.chunked_cross_entropy.default, (
                logits, target, options["ignore_index"], options["reduction"], rows))
            total = gm.graph.call_function(operator.getitem, (both, 0))
        loss_value = node.meta["val"]
        both.meta.update(node.meta)
        both.meta["val"] = (loss_value, loss_value.new_empty(logits.meta["val"].shape[0]))
        total.meta.update(node.meta)
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
        if widened is not None:
            gm.graph.erase_node(widened)
    gm.recompile()
    return gm


def widens_only(node: fx.Node) -> bool:
    """`node` is an fp32 copy of a lower-precision tensor and nothing else reads it (what
    bf16-mixed puts before a loss, which a chunked loss widens a block at a time instead)."""
    if not (node.op == "call_function" and node.target is aten._to_copy.default and len(node.users) == 1):
        return False
    source = node.args[0]
    return (node.kwargs.get("dtype") is torch.float32 and set(node.kwargs) <= {"dtype"}
            and isinstance(source, fx.Node) and source.meta["val"].dtype in (torch.bfloat16, torch.float16))

