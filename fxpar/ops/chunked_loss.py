"""Cross entropy over the vocabulary a block of rows at a time: `torch.ops.fxpar.chunked_cross_entropy`.

`F.cross_entropy(logits, targets)` over N tokens and a vocabulary of V is a log-softmax, whose
[N, V] fp32 output autograd keeps for backward, then the pick of each target. Under bf16-mixed
the logits are bf16 and the loss first copies them to fp32: on GPT-2 124M at 16 x 1024 tokens
that is two 3.3 GB tensors for a loss of one number (6.5 ms of an H200's 55 ms step). This op
computes the same loss `rows` rows at a time:

    for each block of rows:    x = logits[block].float()          # [rows, V], fp32, transient
                               lse[block] = logsumexp(x, 1)        # [rows], kept for backward
                               loss += sum(lse - x[target])        # over valid targets
    backward, per block:       grad[block] = (softmax(x) - onehot(target)) * g, in logits' dtype

so no [N, V] fp32 tensor ever exists: forward keeps the logits as they came (bf16 under
bf16-mixed) and one fp32 number per row; backward writes the logits' gradient block by block.
It is the loss one device computes, up to the order of its fp32 sums (the blocks' partial sums
are added in block order): exact to about 1e-7 relative in fp32.

The reduction is a sum over valid targets (`ignore_index` skipped), as
`passes.loss_normalisation` leaves every mean (the division by the global count of valid
targets is the graph's next node) or a mean, for a graph that still has one.
"""

from __future__ import annotations

import torch

# Rows per block: 4096 rows of a 50k vocabulary are 0.8 GB of fp32 at a time, against the 3.3 GB
# of the whole; small models use one block.
ROWS = 4096


def _blocks(n: int, rows: int):
    return ((start, min(start + rows, n)) for start in range(0, n, rows))


@torch.library.custom_op("fxpar::chunked_cross_entropy", mutates_args=(),
                         schema="(Tensor logits, Tensor targets, int ignore_index, int reduction, int rows) "
                                "-> (Tensor, Tensor)")
def chunked_cross_entropy(logits, targets, ignore_index, reduction, rows):
    """(loss, lse): the summed (reduction 2) or mean (1) fp32 loss, and each row's fp32
    log-sum-exp, which backward reads."""
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    valid = targets != ignore_index
    picked_targets = targets.masked_fill(~valid, 0)
    for start, end in _blocks(logits.shape[0], rows):
        x = logits[start:end].float()
        lse[start:end] = torch.logsumexp(x, dim=1)
        picked = x.gather(1, picked_targets[start:end, None])[:, 0]
        total += ((lse[start:end] - picked) * valid[start:end]).sum()
    if reduction == 1:
        total = total / valid.sum()
    return total, lse


@chunked_cross_entropy.register_fake
def _(logits, targets, ignore_index, reduction, rows):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("fxpar::chunked_cross_entropy_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor logits, Tensor targets, Tensor lse, int ignore_index, "
                                "int reduction, int rows) -> Tensor")
def chunked_cross_entropy_backward(grad, logits, targets, lse, ignore_index, reduction, rows):
    """d loss / d logits, block by block (module doc), in the logits' dtype."""
    valid = targets != ignore_index
    scale = grad.float() / valid.sum() if reduction == 1 else grad.float()
    out = torch.empty_like(logits)
    picked_targets = targets.masked_fill(~valid, 0)
    for start, end in _blocks(logits.shape[0], rows):
        block = torch.exp(logits[start:end].float() - lse[start:end, None])
        block.scatter_add_(1, picked_targets[start:end, None],
                           torch.full((end - start, 1), -1.0, device=block.device))
        block *= (valid[start:end] * scale)[:, None]
        out[start:end] = block
    return out


@chunked_cross_entropy_backward.register_fake
def _(grad, logits, targets, lse, ignore_index, reduction, rows):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, targets, ignore_index, reduction, rows = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.options = (ignore_index, reduction, rows)


def _backward(ctx, grad_loss, grad_lse):
    logits, targets, lse = ctx.saved_tensors
    grad = torch.ops.fxpar.chunked_cross_entropy_backward(grad_loss, logits, targets, lse, *ctx.options)
    return grad, None, None, None, None


chunked_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


# -- the vocabulary-parallel loss's two reductions, a block of rows at a time -------------------
#
# Under tensor parallelism a sharded head gives each rank the logits of its V/t words, and the
# loss is completed by two all-reduces over [N] vectors (`passes.tensor_parallel.vocab_loss`):
# each row's maximum, then each row's (target logit, sum of exponentials), both shifted by the
# global maximum. These two ops compute a rank's share of each reduction block by block, so no
# [N, V/t] fp32 tensor (the widened logits, the shifted ones, their exponentials) ever exists;
# the all-reduces stay graph ops between them, where lowering, the guard and the cost model see
# them.


@torch.library.custom_op("fxpar::chunked_row_max", mutates_args=(), schema="(Tensor logits, int rows) -> Tensor")
def chunked_row_max(logits, rows):
    """Each row's largest logit, in fp32 (no gradient: the shift it makes cancels in the loss)."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start, end in _blocks(logits.shape[0], rows):
        out[start:end] = logits[start:end].float().amax(dim=1)
    return out


@chunked_row_max.register_fake
def _(logits, rows):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("fxpar::chunked_vocab_stats", mutates_args=(),
                         schema="(Tensor logits, Tensor local_target, Tensor outside, Tensor shift, int rows) "
                                "-> Tensor")
def chunked_vocab_stats(logits, local_target, outside, shift, rows):
    """[2, N] fp32: each row's target logit minus `shift` (0 where this rank does not hold the
    target), and the sum over this rank's words of exp(logit - shift)."""
    out = torch.empty(2, logits.shape[0], dtype=torch.float32, device=logits.device)
    for start, end in _blocks(logits.shape[0], rows):
        x = logits[start:end].float() - shift[start:end, None]
        picked = x.gather(1, local_target[start:end, None])[:, 0]
        out[0, start:end] = picked.masked_fill(outside[start:end], 0.0)
        out[1, start:end] = torch.exp(x).sum(dim=1)
    return out


@chunked_vocab_stats.register_fake
def _(logits, local_target, outside, shift, rows):
    return logits.new_empty((2, logits.shape[0]), dtype=torch.float32)


@torch.library.custom_op("fxpar::chunked_vocab_stats_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor logits, Tensor local_target, Tensor outside, Tensor shift, "
                                "int rows) -> Tensor")
def chunked_vocab_stats_backward(grad, logits, local_target, outside, shift, rows):
    """d / d logits of `chunked_vocab_stats` against `grad` [2, N], block by block."""
    out = torch.empty_like(logits)
    picked_grad = grad[0].float().masked_fill(outside, 0.0)
    for start, end in _blocks(logits.shape[0], rows):
        block = torch.exp(logits[start:end].float() - shift[start:end, None]) * grad[1, start:end, None].float()
        block.scatter_add_(1, local_target[start:end, None], picked_grad[start:end, None])
        out[start:end] = block
    return out


@chunked_vocab_stats_backward.register_fake
def _(grad, logits, local_target, outside, shift, rows):
    return torch.empty_like(logits)


def _setup_stats(ctx, inputs, output):
    logits, local_target, outside, shift, rows = inputs
    ctx.save_for_backward(logits, local_target, outside, shift)
    ctx.rows = rows


def _backward_stats(ctx, grad):
    logits, local_target, outside, shift = ctx.saved_tensors
    grad_logits = torch.ops.fxpar.chunked_vocab_stats_backward(grad, logits, local_target, outside, shift, ctx.rows)
    return grad_logits, None, None, None, None


chunked_vocab_stats.register_autograd(_backward_stats, setup_context=_setup_stats)
