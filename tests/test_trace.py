"""Tier 1: capture of the example GPT and the errors capture gives for models it cannot take."""

import sys
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar import CaptureError
from fxpar.frontend.trace import capture
from fxpar.ir import meta

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32)


def example_batch(batch: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))


@pytest.fixture(scope="module")
def gpt_capture():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, capture(model, example_batch())


def test_graph_computes_the_models_loss_at_other_batch_and_sequence_sizes(gpt_capture):
    model, captured = gpt_capture
    for batch, seq in [(4, 16), (2, 8), (6, 32)]:
        inputs = example_batch(batch, seq)
        torch.testing.assert_close(captured.graph_module(*inputs), model(*inputs), rtol=0, atol=0)


def test_state_dict_keys_and_tensors_are_the_models(gpt_capture):
    model, captured = gpt_capture
    gm_state, model_state = captured.graph_module.state_dict(), model.state_dict()
    assert set(gm_state) == set(model_state)
    assert all(gm_state[k] is model_state[k] or gm_state[k].data_ptr() == model_state[k].data_ptr()
               for k in model_state)  # shared, not copied


def test_tied_weights_are_one_parameter_read_through_the_first_name(gpt_capture):
    model, captured = gpt_capture
    assert captured.aliases == {"lm_head.weight": "wte.weight"}
    assert "lm_head.weight" not in captured.parameters
    assert captured.parameter_count() == sum(p.numel() for p in model.parameters())
    reads = [n.target for n in captured.graph_module.graph.nodes if n.op == "get_attr"]
    assert "wte.weight" in reads and "lm_head.weight" not in reads
    assert len(list(captured.graph_module.parameters())) == len(list(model.parameters()))


def test_every_node_knows_its_module_path(gpt_capture):
    _, captured = gpt_capture
    linear_paths = [
        meta.module_path(n)
        for n in captured.graph_module.graph.nodes
        if n.target == torch.ops.aten.linear.default
    ]
    assert linear_paths[:4] == ["h.0.attn.q", "h.0.attn.k", "h.0.attn.v", "h.0.attn.o"]
    assert linear_paths[-1] == "lm_head"
    sdpa = next(
        n for n in captured.graph_module.graph.nodes
        if n.target == torch.ops.aten.scaled_dot_product_attention.default
    )
    assert meta.module_path(sdpa) == "h.0.attn"


def test_dynamic_dims_have_readable_symbols(gpt_capture):
    _, captured = gpt_capture
    batch, seq = captured.symbols["batch"], captured.symbols["seq"]
    assert captured.example_sizes == {batch: 4, seq: 16}
    assert captured.input_names == ("idx", "targets")
    up = next(n for n in captured.graph_module.graph.nodes if meta.module_path(n) == "h.0.mlp.up"
              and n.op == "call_function")
    assert captured.shape(up) == (batch, seq, 128)
    logits = next(n for n in captured.graph_module.graph.nodes if meta.module_path(n) == "lm_head"
                  and n.op == "call_function")
    assert sympy.simplify(sympy.prod(captured.shape(logits)) - 64 * batch * seq) == 0


def test_meta_device_model_is_captured_without_memory():
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=2048, vocab_size=51200, n_layer=4, n_head=16, n_embd=2048))
    captured = capture(model, example_batch(8, 2048))
    assert captured.parameter_count() == sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in captured.graph_module.parameters())
    assert captured.example_sizes[captured.symbols["seq"]] == 2048


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _BranchOnValue()

    def forward(self, x, y):
        return self.inner(x, y)


class _BranchOnValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.proj(x)
        if h.sum() > 0:  # data-dependent control flow
            h = h * 2
        return F.mse_loss(h, y)


def test_data_dependent_branch_names_cause_module_and_hint():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(CaptureError) as error:
        capture(_Branchy(), (x, y))
    message = str(error.value)
    assert "module 'inner'" in message
    assert "hint:" in message and "value of a tensor" in message


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.proj(x)
        return F.mse_loss(h, y), h


class _DictOutput(_TwoOutputs):
    def forward(self, x, y):
        loss, h = super().forward(x, y)
        return {"hidden": h, "loss": loss}


class _NoLoss(_TwoOutputs):
    def forward(self, x, y):
        return {"hidden": self.proj(x)}


def test_the_loss_is_taken_from_a_tuple_or_a_dict_and_the_rest_dropped():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for model in (_TwoOutputs(), _DictOutput()):
        captured = capture(model, (x, y))
        assert captured.graph_module(x, y) == model(x, y)["loss" if isinstance(model, _DictOutput) else 0]
        assert captured.graph_module.graph.output_node().args[0].meta["val"].dim() == 0
    model = _DictOutput()
    keyword = capture(model, {"y": y, "x": x})  # keyword inputs, in the order given
    assert keyword.input_names == ("y", "x") and keyword.keyword_inputs
    assert keyword.arrange(({"x": x, "y": y},), {}) == (y, x)
    assert keyword.graph_module(y, x) == model(x=x, y=y)["loss"]


def test_model_must_return_a_scalar_loss():
    with pytest.raises(CaptureError, match=r"found a dict with \['hidden'\] and no scalar `loss`"):
        capture(_NoLoss(), (torch.randn(4, 4), torch.randn(4, 4)))


def test_keyword_inputs_must_be_forward_parameters():
    with pytest.raises(CaptureError, match="'z' is not a parameter of _TwoOutputs.forward, which takes x, y"):
        capture(_TwoOutputs(), {"x": torch.randn(4, 4), "z": torch.randn(4, 4)})


def test_inputs_must_be_tensors():
    with pytest.raises(CaptureError, match="example input 1 is a int"):
        capture(_TwoOutputs(), (torch.randn(4, 4), 3))


def test_reading_the_example_batch_keeps_the_batch_symbolic(gpt_capture):
    _, captured = gpt_capture
    assert captured.example_batch == 4
    placeholder = next(n for n in captured.graph_module.graph.nodes if n.op == "placeholder")
    assert captured.shape(placeholder) == (captured.symbols["batch"], captured.symbols["seq"])
