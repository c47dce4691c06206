"""Tier 2: matmul rates by shape (`cost.matmul_table`): the table's interpolation, and every
matmul of a step, forward and backward, priced at its own shape's rate."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.cost.hardware import PROFILES
from fxpar.cost.layout import shares
from fxpar.cost.matmul_table import MatmulTable, matmul_shapes, seconds
from fxpar.ir.symbols import BATCH, SEQ

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def test_the_table_is_exact_where_measured_and_bounded_between():
    table = MatmulTable(((64, 64, 64, 1e10), (1024, 64, 64, 4e10), (64, 1024, 64, 2e10), (1024, 1024, 1024, 8e10)))
    for m, k, n, rate in table.points:
        assert table.rate(m, k, n) == pytest.approx(rate, rel=1e-12)
    between = table.rate(256, 64, 64)
    assert 1e10 < between < 4e10  # log-space: nearer 64 rows, nearer its rate
    assert table.rate(1 << 20, 1 << 20, 1 << 20) == pytest.approx(8e10)  # beyond: the largest measured
    assert table.rate(1, 1, 1) == pytest.approx(1e10)  # below: the smallest
    assert all(1e10 <= table.rate(m, k, n) <= 8e10 for m in (8, 100, 3000) for k in (8, 500) for n in (8, 9000))
    assert table.scaled(0.5).rate(1024, 64, 64) == pytest.approx(2e10)


def test_seconds_is_a_formula_until_the_sizes_are_numbers():
    table = MatmulTable(((64, 64, 64, 1e10), (4096, 64, 64, 1e11)))
    formula = seconds(table, 64 * BATCH, 64, 64)
    assert formula.free_symbols == {BATCH}
    assert float(formula.subs(BATCH, 1)) == pytest.approx(2 * 64**3 / 1e10)
    assert float(formula.subs(BATCH, 64)) == pytest.approx(2 * 4096 * 64 * 64 / 1e11)


def test_a_linears_backward_is_its_two_gradients_matmuls():
    assert matmul_shapes("m", "k", "n") == {
        "forward": ("m", "k", "n"), "input_gradient": ("m", "n", "k"), "weight_gradient": ("k", "m", "n")}


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.relu(self.a(x))), y)


@pytest.mark.filterwarnings("ignore:fxpar. the loss is computed by mse_loss")
@pytest.mark.parametrize("plan, rows", [("dp=1", 4), ("dp=2", 2), ("dp=1 mb=2", 2)])
def test_each_matmul_of_a_step_is_priced_at_its_own_shape(plan, rows):
    """x (4 x 8) -> a (8 -> 16) -> relu -> b (16 -> 8). One microbatch of one rank has `rows`
    rows. The forward runs (rows, 8, 16) and (rows, 16, 8); the backward b's input gradient
    (rows, 8, 16) and weight gradient (16, rows, 8), and a's weight gradient (8, rows, 16)
    only: x needs no gradient. With a table measured at exactly these shapes, each at its own
    rate, the compute time grows over that of infinitely fast matmuls by their sum."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    program = fxpar.compile(_TwoLinears(), plan, example_inputs=(x, y))
    rates = {(rows, 8, 16): 1e9, (rows, 16, 8): 2e9, (16, rows, 8): 3e9, (8, rows, 16): 5e9}
    table = MatmulTable(tuple((*shape, rate) for shape, rate in rates.items()))
    priced = replace(PROFILES["h100"], matmul_tables={"fp32": table})
    instant = replace(PROFILES["h100"], peak_flops={"fp32": 1e40, "bf16": 1e40})
    flops = 2 * rows * 8 * 16  # every one of the five
    microbatches = 2 if "mb=2" in plan else 1
    expected = microbatches * flops * (2 / 1e9 + 1 / 2e9 + 1 / 3e9 + 1 / 5e9)
    grown = program.estimate(priced).time["compute"] - program.estimate(instant).time["compute"]
    assert grown == pytest.approx(expected, rel=1e-9)


def test_tensor_parallel_matmuls_are_priced_at_their_rank_local_shape():
    """Under tp=2 a column-parallel linear computes half the outputs (n / 2), a row-parallel one
    reduces over half the inputs (k / 2): the shapes the table is read at on one rank."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    tokens = torch.randint(0, 64, (4, 16))
    (whole,) = shares(fxpar.compile(GPT(config), "dp=1", example_inputs=(tokens, tokens)))
    (split,) = shares(fxpar.compile(GPT(config), "tp=2", example_inputs=(tokens, tokens)))
    rows, d = BATCH * SEQ, 32
    assert whole.dense_shapes[(rows, d, 4 * d)] == 1  # the MLP's up projection
    assert split.dense_shapes[(rows, d, 2 * d)] == 1  # ... column-parallel: n / 2
    assert whole.dense_shapes[(rows, 4 * d, d)] == 1  # its down projection
    assert split.dense_shapes[(rows, 2 * d, d)] == 1  # ... row-parallel: k / 2


@pytest.mark.parametrize("plan", ["dp=1", "tp=2", "pp=2 tp=2 sp=true mb=2", "tp=2 checkpoint=full",
                                  "pp=2 mb=2 schedule=zb-h1"])
def test_the_shapes_account_for_every_dense_flop(plan):
    """Each share's dense shapes are its matmul FLOPs less attention's, the backward's shapes
    twice that (every operand of this GPT's linears needs a gradient), W's and checkpointing's
    shapes the weight-gradient and recomputed FLOPs: the table prices every FLOP, once."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    tokens = torch.randint(0, 64, (4, 16))

    def flops(shapes):
        return sum((2 * sympy.Mul(*shape) * count for shape, count in shapes.items()), sympy.Integer(0))

    for share in shares(fxpar.compile(GPT(config), plan, example_inputs=(tokens, tokens))):
        dense = share.matmul_flops - share.attention_flops
        assert sympy.expand(flops(share.dense_shapes) - dense) == 0
        assert sympy.expand(flops(share.backward_shapes) - 2 * dense) == 0
        assert sympy.expand(flops(share.weight_gradient_shapes) - share.weight_gradient_flops) == 0
        recomputed = share.recompute_matmul_flops - share.recompute_attention_flops
        assert sympy.expand(flops(share.recompute_shapes) - recomputed) == 0
