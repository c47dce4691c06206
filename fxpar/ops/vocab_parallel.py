"""Vocabulary-parallel lookups: the ops that need to know which rows this rank holds.

Rank i of an axis of size t holds rows [i V/t, (i+1) V/t) of a vocabulary-sharded table (an
embedding, or the logits of a head). Two ops in the `fxpar` namespace, neither of which
communicates (the passes add the sums around them as `fxpar.ops.distributed`):

    localize_indices(indices, axis, rows) -> (local, outside)
        each global index as a row of this rank's shard (0 where it lies outside), and where
        it lies outside; integer data, no gradient.
    vocab_parallel_embedding(weight, indices, axis, padding_idx) -> partial lookup
        rows of the local shard, zero for indices outside it, so the sum over the axis is the
        whole lookup (Megatron's embedding); the gradient reaches only the rows looked up,
        and never `padding_idx`'s (the global row, -1 for none), as `aten.embedding` does.
"""

from __future__ import annotations

import torch

from fxpar.ir.axes import bound


@torch.library.custom_op("fxpar::localize_indices", mutates_args=(),
                         schema="(Tensor indices, str axis, int rows) -> (Tensor, Tensor)")
def localize_indices(indices: torch.Tensor, axis: str, rows: int):
    start = bound(axis).index * rows
    outside = (indices < start) | (indices >= start + rows)
    return (indices - start).masked_fill(outside, 0), outside


@localize_indices.register_fake
def _(indices, axis, rows):
    return torch.empty_like(indices), torch.empty_like(indices, dtype=torch.bool)


def _local_padding(axis: str, rows: int, padding_idx: int) -> int:
    start = bound(axis).index * rows
    return padding_idx - start if start <= padding_idx < start + rows else -1


@torch.library.custom_op("fxpar::vocab_parallel_embedding", mutates_args=(),
                         schema="(Tensor weight, Tensor indices, str axis, int padding_idx) -> Tensor")
def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, axis: str, padding_idx: int):
    rows = weight.shape[0]
    local, outside = localize_indices(indices, axis, rows)
    looked_up = torch.ops.aten.embedding(weight, local, _local_padding(axis, rows, padding_idx))
    return looked_up.masked_fill(outside.unsqueeze(-1), 0.0)


@vocab_parallel_embedding.register_fake
def _(weight, indices, axis, padding_idx):
    return weight.new_empty((*indices.shape, weight.shape[1]))


def _setup(ctx, inputs, output):
    weight, indices, ctx.axis, ctx.padding_idx = inputs
    ctx.rows = weight.shape[0]
    ctx.save_for_backward(indices)


def _backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    local, outside = localize_indices(indices, ctx.axis, ctx.rows)
    grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)
    padding = _local_padding(ctx.axis, ctx.rows, ctx.padding_idx)
    grad_weight = torch.ops.aten.embedding_dense_backward(grad, local, ctx.rows, padding, False)
    return grad_weight, None, None, None


vocab_parallel_embedding.register_autograd(_backward, setup_context=_setup)
