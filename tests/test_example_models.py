"""Tier 1: the example Llama and GPT-2 run, capture exactly, train every parameter, and count.

Both models are tiny (two layers, width 64, vocabulary 128) so the file runs in seconds.
Equality with the eager model is exact (rtol=0, atol=0): the captured graph calls the same
aten kernels in the same order on the same parameters, so any difference is a capture bug.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from fxpar.frontend.trace import capture

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: E402
from llama import Llama, LlamaConfig, apply_rotary, rotary_tables  # noqa: E402

VOCAB = 128
LLAMA = LlamaConfig(
    vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96,
    max_seq_len=32,
)
GPT2 = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4)
# (batch, seq) sizes other than the example's: the captured graph has symbolic batch and seq.
OTHER_SIZES = [(2, 8), (6, 32)]


def example_batch(batch: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))


def llama_parameter_count(c: LlamaConfig) -> int:
    V, C, L, I, hs = c.vocab_size, c.n_embd, c.n_layer, c.intermediate_size, c.head_dim
    per_layer = (
        2 * C  # attention_norm, ffn_norm
        + C * (c.n_head * hs)  # q_proj
        + 2 * C * (c.n_kv_head * hs)  # k_proj, v_proj
        + (c.n_head * hs) * C  # o_proj
        + 3 * C * I  # gate_proj, up_proj, down_proj
    )
    return V * C + L * per_layer + C + C * V  # embed_tokens, layers, norm, lm_head (untied)


def gpt2_parameter_count(c: GPT2Config) -> int:
    V, P, C, L = c.vocab_size, c.n_positions, c.n_embd, c.n_layer
    per_layer = (
        2 * 2 * C  # ln_1, ln_2 (weight and bias)
        + C * 3 * C + 3 * C  # attn.c_attn
        + C * C + C  # attn.c_proj
        + C * 4 * C + 4 * C  # mlp.c_fc
        + 4 * C * C + C  # mlp.c_proj
    )
    return V * C + P * C + L * per_layer + 2 * C  # wte (= lm_head, counted once), wpe, ln_f


MODELS = {
    "llama": (lambda: Llama(LLAMA), lambda: llama_parameter_count(LLAMA)),
    "gpt2": (lambda: GPT2LMHeadModel(GPT2), lambda: gpt2_parameter_count(GPT2)),
}


@pytest.fixture(scope="module")
def captures():
    """name -> (model, its capture at batch 4, seq 16), built once for the file."""
    built = {}
    for name, (build, _) in MODELS.items():
        torch.manual_seed(0)
        model = build()
        built[name] = model, capture(model, example_batch())
    return built


@pytest.fixture(params=list(MODELS))
def model_and_capture(request, captures):
    return request.param, *captures[request.param]


def test_loss_at_init_is_a_finite_scalar_near_log_vocab(model_and_capture):
    _, model, _ = model_and_capture
    torch.manual_seed(1)
    loss = model(*example_batch())
    assert loss.dim() == 0 and torch.isfinite(loss)
    # std-0.02 weights make near-uniform logits: the loss of guessing is log(V) = 4.85.
    assert abs(loss.item() - math.log(VOCAB)) < 0.1


def test_graph_computes_the_models_loss_at_other_batch_and_sequence_sizes(model_and_capture):
    _, model, captured = model_and_capture
    assert set(captured.symbols) == {"batch", "seq"}
    torch.manual_seed(2)
    for batch, seq in OTHER_SIZES:
        inputs = example_batch(batch, seq)
        torch.testing.assert_close(captured.graph_module(*inputs), model(*inputs), rtol=0, atol=0)


def test_backward_through_the_graph_reaches_every_parameter(model_and_capture):
    _, model, captured = model_and_capture
    torch.manual_seed(3)
    inputs = example_batch(3, 12)
    model.zero_grad(set_to_none=True)
    model(*inputs).backward()
    eager = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    captured.graph_module(*inputs).backward()  # the graph reads the model's own Parameters
    for name, param in model.named_parameters():
        assert param.grad is not None, f"no gradient reached {name}"
        assert param.grad.abs().sum() > 0, f"the gradient of {name} is all zeros"
        # Same aten ops in the same order, so the same autograd graph: equal to the bit.
        torch.testing.assert_close(param.grad, eager[name], rtol=0, atol=0, msg=name)
    model.zero_grad(set_to_none=True)


def test_parameter_count_matches_the_closed_form(model_and_capture):
    name, model, captured = model_and_capture
    expected = MODELS[name][1]()
    assert sum(p.numel() for p in model.parameters()) == expected  # tied weights once
    assert captured.parameter_count() == expected


def test_llama_module_names_are_the_ones_tensor_parallel_plans_use():
    names = {n for n, _ in Llama(LLAMA).named_parameters()}
    block = [
        "attention_norm.weight", "attention.q_proj.weight", "attention.k_proj.weight",
        "attention.v_proj.weight", "attention.o_proj.weight", "ffn_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]
    layers = {f"layers.{i}.{p}" for i in range(LLAMA.n_layer) for p in block}
    assert names == {"embed_tokens.weight", "norm.weight", "lm_head.weight"} | layers


def test_gpt2_module_names_are_hugging_faces():
    model = GPT2LMHeadModel(GPT2)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    block = [
        "ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj",
    ]
    layers = {
        f"transformer.h.{i}.{m}.{p}" for i in range(GPT2.n_layer) for m in block
        for p in ("weight", "bias")
    }
    top = {
        "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
        "transformer.ln_f.bias", "lm_head.weight",
    }
    assert names == top | layers
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.h[0].attn.c_attn.weight.shape == (3 * GPT2.n_embd, GPT2.n_embd)


def test_gpt2_capture_reads_the_tied_weight_through_wte(captures):
    _, captured = captures["gpt2"]
    assert captured.aliases == {"lm_head.weight": "transformer.wte.weight"}


def test_llama_rotary_tables_stay_out_of_the_state_dict(captures):
    model, captured = captures["llama"]
    assert {"cos", "sin"} <= {n for n, _ in model.named_buffers()}
    assert not {"cos", "sin"} & set(model.state_dict())
    assert set(captured.graph_module.state_dict()) == set(model.state_dict())


def test_rotary_scores_depend_only_on_the_distance_between_positions():
    # RoFormer eq. 16: <R_m q, R_n k> = <q, R_{n-m} k>, so shifting both positions by the same
    # amount leaves the attention score unchanged.
    cos, sin = rotary_tables(LLAMA)  # (max_seq_len, hs)
    torch.manual_seed(4)
    q, k = torch.randn(LLAMA.head_dim), torch.randn(LLAMA.head_dim)

    def score(m: int, n: int) -> torch.Tensor:
        return apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])

    # Tolerance: float32 tables and dot products of 16 terms, values of order 1.
    torch.testing.assert_close(score(3, 7), score(20, 24), rtol=1e-5, atol=1e-5)
    rotated = apply_rotary(q, cos[5], sin[5])
    torch.testing.assert_close(rotated.norm(), q.norm(), rtol=1e-5, atol=1e-5)  # a rotation
