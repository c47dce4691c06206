"""Deferred weight gradients (zero-bubble schedules): the op, its store and the graph pass."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.ops import deferred_linear
from fxpar.ops.deferred_linear import LINEAR
from fxpar.passes.weight_gradients import deferred_weights
from fxpar.runtime.step.weight_gradients import WeightGradientStore

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402


def linear_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 6, generator=generator, requires_grad=True)
    weight = torch.randn(4, 6, generator=generator, requires_grad=True)
    bias = torch.randn(4, generator=generator, requires_grad=True)
    grad = torch.randn(2, 5, 4, generator=generator)
    return x, weight, bias, grad


def reference_gradients():
    x, weight, bias, grad = linear_inputs()
    F.linear(x, weight, bias).backward(grad)
    return x.grad, weight.grad, bias.grad


def test_outside_a_zero_bubble_forward_the_op_is_an_ordinary_linear():
    x, weight, bias, grad = linear_inputs()
    out = deferred_linear.linear(x, weight, bias)
    assert out.grad_fn.name() == F.linear(x, weight, bias).grad_fn.name()
    assert torch.equal(out, F.linear(x, weight, bias))
    out.backward(grad)
    for got, expected in zip((x.grad, weight.grad, bias.grad), reference_gradients()):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_b_leaves_the_weight_gradient_for_w_which_hooks_see_once():
    x, weight, bias, grad = linear_inputs()
    ready = []
    weight.register_post_accumulate_grad_hook(lambda p: ready.append(p.grad.clone()))
    store = WeightGradientStore()
    # The weight feeds two linears: W must hand autograd their sum once, as B would have.
    out = deferred_linear.linear(x, weight, bias, store) + deferred_linear.linear(x, weight, None, store)
    with store.collect((0, 3)):
        out.backward(grad)
    assert weight.grad is None and ready == [] and len(store) == 1
    x_grad, bias_grad = x.grad.clone(), bias.grad.clone()

    store.run((0, 3))
    assert len(store) == 0 and len(ready) == 1
    x2, weight2, bias2, _ = linear_inputs()
    (F.linear(x2, weight2, bias2) + F.linear(x2, weight2)).backward(grad)
    torch.testing.assert_close(weight.grad, weight2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias_grad, bias2.grad, rtol=1e-6, atol=1e-6)


def test_w_accumulates_into_an_existing_gradient():
    x, weight, bias, grad = linear_inputs()
    weight.grad = torch.ones_like(weight)
    store = WeightGradientStore()
    out = deferred_linear.linear(x, weight, bias, store)
    with store.collect((1, 0)):
        out.backward(grad)
    store.run((1, 0))
    torch.testing.assert_close(weight.grad, 1 + reference_gradients()[1], rtol=1e-6, atol=1e-6)


def test_a_deferred_backward_outside_a_b_action_is_an_error():
    x, weight, bias, grad = linear_inputs()
    out = deferred_linear.linear(x, weight, bias, WeightGradientStore())
    with pytest.raises(RuntimeError, match="outside a B action"):
        out.backward(grad)


def test_zero_bubble_stage_modules_defer_exactly_the_linear_weights():
    tokens, labels = global_batches()[0]
    program = fxpar.compile(build_model("gpt"), "pp=2 mb=4 schedule=zb-h1", example_inputs=(tokens, labels))
    for rank in (0, 1):
        module = program.rank_module(rank)
        targets = [n.target for n in module.graph.nodes if n.op == "call_function"]
        assert LINEAR not in targets and deferred_linear.linear in targets
        deferred = deferred_weights(module)
        assert deferred and all(name.endswith("weight") for name in deferred)
        assert not any(".ln_" in name or name.startswith("ln_") for name in deferred)
    # The last stage's head reads the tied embedding, which stage 0 uses as an embedding.
    assert "wte.weight" in deferred_weights(program.rank_module(1))
    assert "wte.weight" not in deferred_weights(program.rank_module(0))
    # Other schedules run the model's own linears.
    one_f_one_b = fxpar.compile(build_model("gpt"), "pp=2 mb=4", example_inputs=(tokens, labels))
    assert deferred_weights(one_f_one_b.rank_module(1)) == []


def test_a_weight_also_read_by_another_op_keeps_its_gradient_in_b():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.other = torch.nn.Linear(4, 4)

        def forward(self, tokens):
            h = self.other(self.embed(tokens))
            return F.linear(h, self.embed.weight).sum()

    from fxpar.frontend.trace import capture
    from fxpar.passes.weight_gradients import defer_weight_gradients

    module = defer_weight_gradients(capture(Tied(), (torch.tensor([[1, 2, 3]]),)).graph_module)
    assert deferred_weights(module) == ["other.weight"]


def test_a_stage_takes_the_store_as_its_last_input_and_defers_only_when_given_one():
    """The graph module holds no runtime object: the executor passes its store with each F."""
    from fxpar.passes.weight_gradients import STORE_INPUT, takes_weight_gradients

    tokens, labels = global_batches()[0]
    program = fxpar.compile(build_model("gpt"), "pp=2 mb=4 schedule=zb-h1", example_inputs=(tokens, labels))
    module = program.rank_module(0)
    assert takes_weight_gradients(module)
    assert [n.name for n in module.graph.nodes if n.op == "placeholder"] == ["idx", STORE_INPUT]
    assert f"def forward(self, idx, {STORE_INPUT} = None):" in module.code
    assert not any(isinstance(value, WeightGradientStore) for value in vars(module).values())

    def gradients(*store: WeightGradientStore) -> dict[str, torch.Tensor]:
        module.zero_grad(set_to_none=True)
        (out,) = module(tokens, *store)
        with store[0].collect((0, 0)) if store else torch.enable_grad():
            out.square().sum().backward()
        if store:
            assert all(p.grad is None for n, p in module.named_parameters() if n in deferred_weights(module))
            store[0].run((0, 0))
        return {n: p.grad.clone() for n, p in module.named_parameters()}

    ordinary, deferred = gradients(), gradients(WeightGradientStore())
    assert ordinary.keys() == deferred.keys()
    for name in ordinary:
        torch.testing.assert_close(deferred[name], ordinary[name], rtol=1e-5, atol=1e-6)
    one_f_one_b = fxpar.compile(build_model("gpt"), "pp=2 mb=4", example_inputs=(tokens, labels))
    assert not takes_weight_gradients(one_f_one_b.rank_module(0))
