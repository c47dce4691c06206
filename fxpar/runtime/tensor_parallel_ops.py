"""Tensor-parallel collectives as graph ops: autograd functions with Megatron's semantics.

Each op takes a `RankGroup` (the rank module's `tp_group`) and is what the tensor-parallel
pass inserts into the graph; its backward is the dual collective (Shoeybi et al. 2019, Sec. 3;
Korthikanti et al. 2022, Sec. 4.2.2):

    op                     forward          backward         where
    all_reduce             all-reduce       identity         g: leaving a row-parallel linear
    copy_to_region         identity         all-reduce       f: entering column-parallel math
    split_to_shard         local slice      all-gather       a replicated value meets a shard
    all_gather             all-gather       local slice      a shard must become whole
    gather_to_region       all-gather       reduce-scatter   sequence parallelism's f
    reduce_scatter         reduce-scatter   all-gather       sequence parallelism's g

torch's functional collectives are not used: their all_reduce also all-reduces the gradient,
which multiplies the gradient of a replicated loss by the group size.
"""

from __future__ import annotations

import torch

from fxpar.errors import BindError
from fxpar.runtime.process_groups import RankGroup


def _bound(group: RankGroup) -> RankGroup:
    if group.communicator is None:
        raise BindError(
            f"this rank module communicates on the {group.name} but is not bound to processes; "
            "run it through `program.bind()` inside torchrun"
        )
    return group


def _reduce(x: torch.Tensor, group: RankGroup, tag: str, *, phase: str, op: str = "sum") -> torch.Tensor:
    x = x.contiguous()
    _bound(group).communicator.all_reduce_now(x, group, tag=tag, op=op, phase=phase)
    return x


def _gather(x: torch.Tensor, group: RankGroup, dim: int, tag: str, phase: str) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * group.size, *moved.shape[1:]))
    _bound(group).communicator.all_gather_now(out, moved, group, tag=tag, phase=phase)
    return out.movedim(0, dim).contiguous()


def _scatter(x: torch.Tensor, group: RankGroup, dim: int, tag: str, phase: str) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // group.size, *moved.shape[1:]))
    _bound(group).communicator.reduce_scatter_now(out, moved, group, tag=tag, phase=phase)
    return out.movedim(0, dim).contiguous()


def _slice(x: torch.Tensor, group: RankGroup, dim: int) -> torch.Tensor:
    return x.chunk(group.size, dim=dim)[group.index].contiguous()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x.clone(), group, "tp all_reduce (g)", phase="forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad.clone(), ctx.group, "tp all_reduce (f backward)", phase="backward"), None


class _SplitToShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim, "tp all_gather (split backward)", "backward"), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim, "tp all_gather", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.group, ctx.dim), None, None


class _GatherToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim, "sp all_gather", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.group, ctx.dim, "sp reduce_scatter (backward)", "backward"), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _scatter(x, group, dim, "sp reduce_scatter", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim, "sp all_gather (backward)", "backward"), None, None


def all_reduce(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    return _AllReduce.apply(x, group)


def copy_to_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def split_to_shard(x: torch.Tensor, group: RankGroup, dim: int) -> torch.Tensor:
    return _SplitToShard.apply(x, group, dim)


def all_gather(x: torch.Tensor, group: RankGroup, dim: int) -> torch.Tensor:
    return _AllGather.apply(x, group, dim)


def gather_to_region(x: torch.Tensor, group: RankGroup, dim: int) -> torch.Tensor:
    return _GatherToRegion.apply(x, group, dim)


def reduce_scatter(x: torch.Tensor, group: RankGroup, dim: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, group, dim)


def vocab_parallel_embedding(
    weight: torch.Tensor, indices: torch.Tensor, group: RankGroup, padding_idx: int = -1
) -> torch.Tensor:
    """Look up rows of a vocabulary-sharded table: a Partial result (Megatron's embedding).

    Rank i holds rows [i V/t, (i+1) V/t); tokens outside them read row 0 and are zeroed (so is
    their gradient), so the sum over ranks is the full lookup. `padding_idx` is the global
    row whose gradient stays zero (-1: none), as `aten.embedding` takes it: the rank holding
    that row passes its local index on, the others have no padding row.
    """
    rows = weight.shape[0]
    start = group.index * rows
    outside = (indices < start) | (indices >= start + rows)
    local = (indices - start).masked_fill(outside, 0)
    local_padding = padding_idx - start if start <= padding_idx < start + rows else -1
    looked_up = torch.ops.aten.embedding(weight, local, local_padding)
    return looked_up.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over vocabulary-sharded logits without gathering them (Megatron-LM).

    Two all-reduces: the max logit per token (for stability), then the target logit and the
    sum of exponentials per token together.
    """

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, reduction):
        rows, vocab = logits.shape
        start = group.index * vocab
        logits_max = _reduce(logits.detach().amax(dim=-1), group, "vocab-parallel max", op="max", phase="forward")
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + vocab)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        # Both sums depend only on the max: one all-reduce carries the two of them.
        both = _reduce(torch.stack([picked, exp.sum(dim=-1)]), group,
                       "vocab-parallel target logit and sum of exponentials", phase="forward")
        picked, sum_exp = both[0], both[1]
        loss = sum_exp.log() - picked
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside, valid, count)
        ctx.reduction = reduction
        if reduction == "mean":
            return loss.sum() / count
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, outside, valid, count = ctx.saved_tensors
        grad_logits = softmax
        inside = (~outside).to(softmax.dtype)
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        grad_logits.mul_(valid.unsqueeze(-1).to(softmax.dtype))
        scale = grad / count if ctx.reduction == "mean" else grad
        return grad_logits * scale, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: RankGroup, ignore_index: int, reduction: str
) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, reduction)
