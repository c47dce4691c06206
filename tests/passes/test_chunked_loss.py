"""`loss=chunked` (`ops.chunked_loss`, `passes.chunked_loss`): the cross entropy a block of rows
at a time equals the whole one, the pass leaves no whole-vocabulary loss (and no fp32 copy of
bf16 logits), the estimate counts what the op keeps, and a vocabulary-parallel loss is refused.

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
from fxpar.errors import PlanError
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


def test_a_vocabulary_parallel_loss_is_refused_with_a_fix():
    tokens, labels = global_batches()[0]
    with pytest.raises(PlanError, match=r"loss=chunked: .*vocabulary-parallel.* Fix: loss=full"):
        fxpar.compile(build_model("gpt"), "tp=2 loss=chunked", (tokens, labels))
