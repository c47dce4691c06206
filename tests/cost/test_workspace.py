"""Tier 2: what backward allocates beside the saved activations (`cost.workspace`).

Each term is checked against the thing it reads: the step program's transfers, the stage's
ops, the zero-bubble store. The measured peaks these terms close (4 CPU ranks) are in the
module doc of `cost.workspace`; benchmarks/bench_planner.py measures every plan.
"""

import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.cost.estimate import rank_memory_formulas
from fxpar.cost.workspace import backward_bytes, gathered_bytes, transfer_bytes, waiting_for_w
from fxpar.ir.symbols import BATCH, SEQ

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

H, V = 64, 256
CONFIG = GPTConfig(n_layer=2, n_embd=H, n_head=4, vocab_size=V, block_size=64)
SIZES = {BATCH: 16, SEQ: 32}


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    tokens = torch.randint(0, V, (16, 32))
    return fxpar.capture(GPT(CONFIG), (tokens, tokens))


def _bytes(formula) -> float:
    return float(formula.subs(SIZES))


@pytest.mark.parametrize("microbatches", [4, 8])
def test_a_pipeline_rank_holds_every_send_of_the_step_and_two_receives(captured, microbatches):
    """The executor waits for sends at the end of the step; receives go one action ahead."""
    program = fxpar.compile(captured, f"dp=2 pp=2 mb={microbatches}")
    boundary = 16 // (2 * microbatches) * 32 * H * 4  # one microbatch's hidden state, fp32
    # Stage 0 sends each microbatch's activations and receives their gradients; stage 1 the reverse.
    for rank in (0, 1):
        assert _bytes(transfer_bytes(program, rank)) == (microbatches + 2) * boundary
    assert transfer_bytes(fxpar.compile(captured, "dp=2"), 0) == 0


def test_a_stage_without_the_loss_prices_its_largest_op_backward(captured):
    """Stage 0 of a GPT: an MLP linear's backward, the hidden's gradient with the weight's and
    the input's (the fp32 numbers of `cost.workspace`'s module doc)."""
    program = fxpar.compile(captured, "dp=2 pp=2 mb=4")
    one_op, deferred = backward_bytes(program, 0)
    rows = 16 * 32  # the global batch's tokens: the estimate substitutes a rank's microbatch
    mlp_in = 4 * (rows * H + 4 * H * H + 4 * H + rows * 4 * H)  # x, weight, bias, hidden
    mlp_out = 4 * (rows * 4 * H + H * 4 * H + H + rows * H)
    gelu = 4 * 2 * rows * 4 * H
    assert _bytes(one_op) == max(mlp_in, mlp_out, gelu) and deferred == 0
    terms = rank_memory_formulas(program, 0)
    assert _bytes(terms["workspace"]) == _bytes(one_op.subs(BATCH, BATCH / 8) + transfer_bytes(program, 0))


def test_zero_bubble_keeps_the_deferred_weight_gradients_of_the_microbatches_between_b_and_w(captured):
    one_f_one_b = fxpar.compile(captured, "dp=2 pp=2 mb=4")
    zero_bubble = fxpar.compile(captured, "dp=2 pp=2 mb=4 schedule=zb-h1")
    pending = waiting_for_w(zero_bubble.schedule)
    assert min(pending) >= 1
    # Each deferred linear keeps its input and its output's gradient: per row, a block's q/k/v
    # (H + 3H), output projection (H + H), MLP in (H + 4H) and out (4H + H); the last stage's
    # head too (H + V), its weight tied to the embedding on the other stage. Every one counted,
    # in every run (the store's tensors were once keyed by ids their storages could hand on).
    rows = BATCH * SEQ
    expected = {0: 4 * rows * 16 * H, 1: 4 * rows * (16 * H + H + V)}
    for rank in (0, 1):
        _, deferred = backward_bytes(zero_bubble, rank)
        assert deferred == expected[rank] * pending[rank]
        grown = rank_memory_formulas(zero_bubble, rank)["workspace"] - rank_memory_formulas(one_f_one_b, rank)["workspace"]
        assert _bytes(grown) == pytest.approx(_bytes(deferred.subs(BATCH, BATCH / 8)))


def test_zero3_holds_a_layer_gathered_whole_the_next_in_flight_and_a_reduce_scatter(captured):
    """ZeRO-3's term: the layer its backward reads, gathered whole (flat buffer and the values
    copied out of it), the next `prefetch` layers' gathers in flight (each its buffer and this
    rank's laid-out pieces), and the reduce-scatter of the layer above (laid out whole when
    reduced per microbatch; received whole by fxpar's all-to-all on gloo). A GPT block of
    width H: 12 H^2 + 13 H parameters, fp32."""
    layer = 4 * (12 * H * H + 13 * H)
    for prefetch, reduce, in_flight in ((1, "microbatch", 2), (0, "microbatch", 2), (2, "step", 1)):
        plan = f"dp=2 zero=3 mb=2 prefetch={prefetch} zero_reduce={reduce}"
        gathered = gathered_bytes(fxpar.compile(captured, plan), 0)
        assert gathered == 2 * layer + prefetch * (layer + layer // 2) + in_flight * layer, plan
    # On the loss's rank it comes after the loss's backward has freed its W: the larger of the two.
    program = fxpar.compile(captured, "dp=2 zero=3")
    loss = 2 * 16 // 2 * 32 * V * 4  # twice the rank's logits, fp32
    assert _bytes(rank_memory_formulas(program, 0)["workspace"]) == max(loss, _bytes(gathered_bytes(program, 0)))
    # A pipeline stage without the loss holds it beside one op's backward.
    program = fxpar.compile(captured, "dp=2 pp=2 mb=4 zero=3")
    one_op, _ = backward_bytes(program, 0)
    expected = one_op.subs(BATCH, BATCH / 8) + gathered_bytes(program, 0) + transfer_bytes(program, 0)
    assert _bytes(rank_memory_formulas(program, 0)["workspace"]) == _bytes(expected)
    assert gathered_bytes(fxpar.compile(captured, "dp=2 zero=2"), 0) == 0  # nothing gathered
    with pytest.warns(UserWarning, match="nothing is sharded"):
        alone = fxpar.compile(captured, "zero=3")  # ZeRO-3 over one rank
    assert gathered_bytes(alone, 0) == 0
