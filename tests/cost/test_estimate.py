"""Tier 2/4: Estimate's numbers, formulas, report, errors, and a 1024-rank plan on meta."""

import sys
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.cost.estimate import mfu
from fxpar.cost.ops import cost_of
from fxpar.cost.symbols import BATCH, SEQ
from fxpar.trace import capture

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    return fxpar.compile(GPT(CONFIG), "dp=2 bucket_mb=0.1", example_inputs=(tokens, tokens))


def test_numbers_are_the_formulas_at_the_example_sizes(program):
    estimate = program.estimate("h100")
    assert estimate.sizes == {"batch": 8, "seq": 32}
    for group in ("flops", "memory", "time"):
        for key, value in getattr(estimate, group).items():
            formula = estimate.formulas[f"{group}.{key}"]
            assert float(formula.subs({BATCH: 8, SEQ: 32})) == pytest.approx(value, rel=1e-3)
    assert estimate.flops["total"] == estimate.flops["matmul"] + estimate.flops["other"]
    assert estimate.memory["total"] == pytest.approx(
        sum(estimate.memory[k] for k in ("params", "grads", "optimizer", "activations"))
    )
    assert estimate.uncosted == {}


def test_other_sizes_can_be_asked_for(program):
    small, large = program.estimate("h100"), program.estimate("h100", batch=32, seq=64)
    assert large.sizes == {"batch": 32, "seq": 64}
    assert large.flops["matmul"] > 4 * small.flops["matmul"]  # 4x tokens, longer attention
    assert large.memory["params"] == small.memory["params"]


def test_comm_is_the_programs_collectives(program):
    estimate = program.estimate("h100")
    calls = program.collectives(0)
    assert estimate.comm["all_reduce"]["count"] == len(calls)
    assert estimate.comm["all_reduce"]["payload_bytes"] == sum(c.payload_bytes for c in calls)
    assert estimate.comm["all_reduce"]["wire_bytes"] == sum(c.payload_bytes for c in calls)  # n=2


def test_table_shows_numbers_and_formulas(program):
    table = program.estimate("h100").table()
    assert "plan 'dp=2 bucket_mb=0.1' on h100" in table
    assert "flops.matmul" in table and "batch*seq" in table
    assert "memory.activations" in table and "comm.all_reduce" in table
    assert "uncosted ops          none" in table


def test_unknown_hardware_lists_the_profiles(program):
    with pytest.raises(ValueError, match="unknown hardware 'tpu'; known profiles: cpu, a100, h100, h200"):
        program.estimate("tpu")


def test_mfu_convention():
    # 6 * 124M params * 16 * 1024 tokens in 0.1 s on one 989 TFLOP/s device.
    assert mfu(6 * 124e6 * 16 * 1024, 0.1, 1, 989e12) == pytest.approx(0.1233, rel=1e-3)


class _Cumulative(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, y):
        return F.mse_loss(torch.cumsum(self.proj(x), dim=1), y)


def test_an_op_without_a_rule_is_costed_by_bytes_and_named():
    x = torch.randn(4, 8)
    program = fxpar.compile(_Cumulative(), "dp=1", example_inputs=(x, x))
    estimate = program.estimate("h100")
    assert estimate.uncosted == {"aten.cumsum.default": 1}
    assert "aten.cumsum.default x1" in estimate.table()
    captured = capture(_Cumulative(), (x, x))
    node = next(n for n in captured.graph_module.graph.nodes if "cumsum" in str(n.target))
    cost = cost_of(node, captured.shape)
    assert not cost.costed and cost.bytes == 2 * BATCH * 8 * 4  # read and write (batch, 8) fp32


def test_linear_and_attention_rules():
    torch.manual_seed(0)
    captured = capture(GPT(CONFIG), (torch.randint(0, 256, (4, 16)),) * 2)
    nodes = list(captured.graph_module.graph.nodes)
    q = next(n for n in nodes if str(n.target) == "aten.linear.default")
    sdpa = next(n for n in nodes if "scaled_dot_product" in str(n.target))
    assert cost_of(q, captured.shape).matmul_flops == 2 * BATCH * SEQ * 64 * 64
    assert cost_of(q, captured.shape).other_flops == BATCH * SEQ * 64  # the bias add
    assert sympy.expand(cost_of(sdpa, captured.shape).matmul_flops - 4 * BATCH * SEQ**2 * 64) == 0


def test_a_1024_rank_plan_of_a_meta_model_is_estimated():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=12288, n_head=96, vocab_size=51200, block_size=2048))
    tokens = torch.randint(0, 51200, (1024, 2048))
    program = fxpar.compile(model, "dp=1024 zero=3 precision=bf16-mixed", example_inputs=(tokens, tokens))
    program.check()
    estimate = program.estimate("h100")
    P = program.captured.parameter_count()
    assert estimate.memory["params"] + estimate.memory["grads"] + estimate.memory["optimizer"] == (
        pytest.approx(16 * P / 1024)
    )
    assert estimate.comm["all_gather"]["count"] == 2 * len(program.buckets)
    assert estimate.time["total"] > estimate.time["compute"] > 0
    assert 0 < estimate.mfu() < 1
