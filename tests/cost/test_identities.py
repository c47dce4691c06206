"""Tier 2: the cost model reproduces published closed forms exactly, symbolically."""

import sys
from pathlib import Path

import pytest
import sympy
import torch

import fxpar
from fxpar.cost.collectives import wire_bytes
from fxpar.cost.memory import model_state_bytes
from fxpar.ir import meta
from fxpar.ir.symbols import BATCH, SEQ

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

SHAPES = [  # (layers, hidden, heads, vocabulary, positions)
    (2, 64, 4, 256, 64),
    (3, 96, 6, 512, 128),
]


def compile_gpt(L, h, a, V, s, plan="dp=1", device="meta"):
    with torch.device(device):
        model = GPT(GPTConfig(n_layer=L, n_embd=h, n_head=a, vocab_size=V, block_size=s))
    tokens = torch.randint(0, V, (4, s))
    return fxpar.compile(model, plan, example_inputs=(tokens, tokens))


@pytest.mark.parametrize("L, h, a, V, s", SHAPES)
def test_training_matmul_flops_are_korthikanti_eq_7(L, h, a, V, s):
    program = compile_gpt(L, h, a, V, s)
    flops = program.estimate("h100").formulas["flops.matmul"]
    B, T = BATCH, SEQ  # symbolic: the formula holds for every batch and sequence length
    published = 72 * B * L * T * h**2 * (1 + T / (6 * h) + sympy.Rational(V, 12 * h * L))
    assert sympy.simplify(flops - published) == 0


@pytest.mark.parametrize("L, h, a, V, s", SHAPES)
def test_parameter_count_is_narayanan_eq_2_plus_the_final_norm(L, h, a, V, s):
    program = compile_gpt(L, h, a, V, s)
    published = 12 * L * h**2 + 13 * L * h + (V + s) * h
    assert program.captured.parameter_count() == published + 2 * h  # + final LayerNorm
    assert program.estimate("h100").params == published + 2 * h


def test_zero_model_states_are_rajbhandari_sec_5():
    P, N = sympy.symbols("P N", positive=True)
    total = {
        zero: sum(model_state_bytes(P, precision="bf16-mixed", optimizer="adamw", zero=zero, dp=N,
                                    reduce_dtype="bf16").values())
        for zero in range(4)
    }
    assert sympy.simplify(total[0] - 16 * P) == 0
    assert sympy.simplify(total[1] - (4 * P + 12 * P / N)) == 0
    assert sympy.simplify(total[2] - (2 * P + 14 * P / N)) == 0
    assert sympy.simplify(total[3] - 16 * P / N) == 0
    # The paper's example: 7.5B parameters over 64 ranks.
    example = [float(total[z].subs({P: 7.5e9, N: 64})) / 1e9 for z in range(4)]
    assert example == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


def test_mixed_precision_with_fp32_reduction_keeps_fp32_gradient_shards():
    """reduce_dtype=fp32 (the default): ZeRO's reduced gradient shard is fp32, 4P/N, beside
    ZeRO-1's bf16 bucket (2P); DDP keeps the bf16 bucket; nothing reduced at dp=1 (2P)."""
    P, N = sympy.symbols("P N", positive=True)
    grads = {zero: model_state_bytes(P, precision="bf16-mixed", optimizer="adamw", zero=zero, dp=N)["grads"]
             for zero in range(4)}
    assert grads == {0: 2 * P, 1: 2 * P + 4 * P / N, 2: 4 * P / N, 3: 4 * P / N}
    state = model_state_bytes(P, precision="bf16-mixed", optimizer="adamw", zero=2, dp=1)
    assert state == {"params": 2 * P, "grads": 2 * P, "optimizer": 12 * P}


def test_zero3_with_fp32_reduction_stores_fp32_pieces_as_fsdp2():
    """bf16-mixed ZeRO-3 with reduce_dtype=fp32: each piece is its own fp32 master (FSDP2's
    sharded fp32 parameters, gathered in bf16), so 4P/N + 4P/N + 8P/N, the paper's 16P/N in
    all; with reduce_dtype=bf16 the paper's 2P/N + 2P/N + 12P/N; with dp=1 nothing is sharded."""
    P, N = sympy.symbols("P N", positive=True)
    fp32 = model_state_bytes(P, precision="bf16-mixed", optimizer="adamw", zero=3, dp=N)
    assert fp32 == {"params": 4 * P / N, "grads": 4 * P / N, "optimizer": 8 * P / N}
    bf16 = model_state_bytes(P, precision="bf16-mixed", optimizer="adamw", zero=3, dp=N, reduce_dtype="bf16")
    assert bf16 == {"params": 2 * P / N, "grads": 2 * P / N, "optimizer": 12 * P / N}
    assert sympy.simplify(sum(fp32.values()) - sum(bf16.values())) == 0
    alone = model_state_bytes(P, precision="bf16-mixed", optimizer="adamw", zero=3, dp=1)
    assert alone == {"params": 2 * P, "grads": 2 * P, "optimizer": 12 * P}


def test_fp32_adam_model_states_are_4_4_8():
    state = model_state_bytes(10, precision="fp32", optimizer="adamw", zero=0, dp=1)
    assert state == {"params": 40, "grads": 40, "optimizer": 80}


def test_ring_wire_bytes():
    M, n = sympy.Symbol("M", positive=True), 8
    assert wire_bytes("all_reduce", M, n) == sympy.Rational(2 * (n - 1), n) * M
    assert wire_bytes("reduce_scatter", M, n) == wire_bytes("all_gather", M, n) == sympy.Rational(7, 8) * M
    assert wire_bytes("all_reduce", M, 1) == 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_estimated_model_state_of_a_program_follows_the_stage(zero):
    program = compile_gpt(*SHAPES[0], plan=f"dp=4 zero={zero} precision=bf16-mixed reduce_dtype=bf16")
    P = program.captured.parameter_count()
    memory = program.estimate("h100").memory
    expected = {0: 16 * P, 1: 4 * P + 12 * P / 4, 2: 2 * P + 14 * P / 4, 3: 16 * P / 4}[zero]
    # Plus what the paper's per-parameter count leaves out: AdamW's 4-byte `step` counter per
    # tensor the rank updates: every parameter (its flat piece under stage 3), under stages 1
    # and 2 one flat shard per bucket.
    tensors = len(program.buckets) if zero in (1, 2) else len(program.captured.parameters)
    assert memory["params"] + memory["grads"] + memory["optimizer"] == pytest.approx(
        expected + 4 * tensors, rel=1e-12)


@pytest.mark.parametrize("zero, volume", [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_data_parallel_traffic_is_2p_or_3p_for_zero_3(zero, volume):
    """docs/design.md, "Communication" / ZeRO Sec. 7: DP and ZeRO-1/2 move 2P per step, ZeRO-3 3P (wire, ring):
    each layer gathered for forward and again for backward (reshard_after_forward=true, the
    default), its gradients reduce-scattered. Except the root's layer (embeddings, final
    norm, head), which is not gathered again: its backward, the head's, follows its forward at
    once (FSDP2's default keeps the root the same way), so ZeRO-3 moves 3P - P_root."""
    program = compile_gpt(*SHAPES[0], plan=f"dp=4 zero={zero} bucket_mb=0.05")
    P = program.captured.parameter_count()
    comm = program.estimate("h100").comm
    wire = sum(entry["wire_bytes"] for entry in comm.values())
    root = 0
    if zero == 3:
        (unit,) = [u for u in meta.graph_parameter_units(program.graph_module) if not u.layer]
        root = sum(program.captured.parameters[name].numel() for name in unit.parameters)
    # Ring: each payload byte crosses (n-1)/n of the ranks; padding adds < n elements a bucket.
    assert wire == pytest.approx((volume * P - root) * 4 * 3 / 4, rel=1e-3)
