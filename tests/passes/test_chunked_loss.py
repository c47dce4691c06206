"""`loss=chunked` (`ops.chunked_loss`, `passes.chunked_loss`): the cross entropy a block of rows
at a time equals the whole one, the pass leaves no whole-vocabulary loss (and no fp32 copy of
bf16 logits), the estimate counts what the op keeps; a vocabulary-parallel loss is chunked by
the tensor-parallel rewrite, its two reductions equal to the written-out ones.

Tolerance: fp32 relative 1e-6 on the loss and the gradient. Each row's log-sum-exp and target
pick are the whole loss's; only the order of the fp32 sum over rows differs (blocks' partial
sums, added in block order), a few ulps (measured 1e-7).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxpar
import fxpar.ops.chunked_loss  # noqa: F401  (registers the op)

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", [1, 2])  # mean, sum (torch's enum)
def test_blocks_of_rows_give_the_whole_loss_and_gradient(dtype, reduction):
    torch.manual_seed(0)
    logits = torch.randn(37, 50, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    targets[[3, 10]] = -100  # ignored, as padding is
    loss, _ = torch.ops.fxpar.chunked_cross_entropy(logits, targets, -100, reduction, 8)  # five blocks
    whole = F.cross_entropy(logits.float(), targets, ignore_index=-100,
                            reduction="mean" if reduction == 1 else "sum")
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(whole.item(), rel=1e-6)
    (grad,), (expected,) = torch.autograd.grad(loss, logits), torch.autograd.grad(whole, logits)
    assert grad.dtype == dtype  # the gradient in the logits' own dtype, as the copy's backward gives it
    assert (grad.float() - expected.float()).norm() <= 1e-6 * expected.float().norm()
    assert grad[3].abs().sum() == 0 and grad[10].abs().sum() == 0


def _loss_nodes(program) -> list[str]:
    module = program.stage_modules(0)[-1]
    return [str(n.target) for n in module.graph.nodes
            if "cross_entropy" in str(n.target) or str(n.target) == "aten._to_copy.default"]


def test_the_pass_chunks_the_loss_and_drops_bf16_mixeds_fp32_copy_of_the_logits():
    tokens, labels = global_batches()[0]
    full = fxpar.compile(build_model("gpt"), "precision=bf16-mixed", (tokens, labels))
    chunked = fxpar.compile(build_model("gpt"), "precision=bf16-mixed loss=chunked", (tokens, labels))
    assert _loss_nodes(full) == ["aten._to_copy.default", "aten.cross_entropy_loss.default"]
    assert _loss_nodes(chunked) == ["fxpar.chunked_cross_entropy.default"]
    # The estimate's fake forward counts what the op keeps: the bf16 logits and one fp32
    # number per row, instead of the fp32 log-softmax and the nll loss's 0-dim total weight.
    logits, rows = 8 * 16 * 64, 8 * 16  # batch x seq x vocabulary of the tiny GPT
    assert (full.estimate("cpu").memory["activations"] - chunked.estimate("cpu").memory["activations"]
            == (4 * logits + 4) - (2 * logits + 4 * rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vocabulary_parallel_reductions_in_blocks_equal_the_written_out_ones(dtype):
    """A rank's share of the vocabulary-parallel loss (`passes.tensor_parallel.vocab_loss`):
    each row's maximum, then its shifted target logit and sum of exponentials, and their
    gradient, equal the ops the unchunked rewrite writes out (the same fp32 ops per row)."""
    torch.manual_seed(0)
    logits = torch.randn(37, 20, dtype=dtype, requires_grad=True)
    local_target, outside = torch.randint(0, 20, (37,)), torch.rand(37) < 0.5
    shift = torch.ops.fxpar.chunked_row_max(logits.detach(), 8)
    assert torch.equal(shift, logits.detach().float().amax(1))
    stats = torch.ops.fxpar.chunked_vocab_stats(logits, local_target, outside, shift, 8)
    shifted = logits.float() - shift[:, None]
    expected = torch.stack([shifted.gather(1, local_target[:, None])[:, 0].masked_fill(outside, 0),
                            shifted.exp().sum(1)])
    assert torch.allclose(stats, expected, rtol=1e-6, atol=0)
    weights = torch.randn(2, 37)
    (grad,), (want,) = (torch.autograd.grad((s * weights).sum(), logits) for s in (stats, expected))
    assert grad.dtype == dtype and (grad.float() - want.float()).norm() <= 1e-6 * want.float().norm()


def test_a_vocabulary_parallel_loss_is_chunked_by_the_tensor_parallel_rewrite():
    tokens, labels = global_batches()[0]
    full, chunked = ([str(n.target) for n in fxpar.compile(build_model("gpt"), plan, (tokens, labels))
                      .stage_modules(0)[0].graph.nodes]
                     for plan in ("tp=2 precision=bf16-mixed", "tp=2 loss=chunked precision=bf16-mixed"))
    assert "fxpar.chunked_vocab_stats.default" in chunked and "fxpar.chunked_row_max.default" in chunked
    assert "aten.exp.default" in full and "aten.exp.default" not in chunked  # (the GPT's only exp)
    # bf16-mixed's fp32 copy of the logits is gone
    assert chunked.count("aten._to_copy.default") == full.count("aten._to_copy.default") - 1
