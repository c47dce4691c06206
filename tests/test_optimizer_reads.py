"""Tier 1: an optimizer that reads whole tensors is refused wherever a rank steps pieces.

Adam steps half of a matrix as it steps that half of the whole matrix; Adafactor (factored
row and column moments) and Muon (an orthogonalised update) do not, so under tensor
parallelism or ZeRO they would train something else than one device, silently. The first
test shows the difference; the others that `runner.optimizer`'s check
(`runtime.state.optimizer_reads`) refuses such an optimizer where the plan splits a parameter it
steps, naming the parameter and its placement, and takes it where every parameter is whole.
"""

import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.runtime.state.optimizer_reads import require_elementwise_for_pieces

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402


def _stepped(optimizer_class, pieces: list[torch.Tensor], grads: list[torch.Tensor], **options) -> torch.Tensor:
    """The pieces (columns of one matrix) after one step of `optimizer_class` on each alone."""
    pieces = [torch.nn.Parameter(p.clone()) for p in pieces]
    for p, g in zip(pieces, grads):
        p.grad = g.clone()
    optimizer_class(pieces, **options).step()
    return torch.cat([p.detach() for p in pieces], dim=1)


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adafactor, torch.optim.Muon])
def test_a_whole_tensor_optimizer_steps_a_shard_differently(optimizer_class):
    generator = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)
    whole = _stepped(optimizer_class, [weight], [grad], lr=0.1)
    halves = _stepped(optimizer_class, list(weight.chunk(2, dim=1)), list(grad.chunk(2, dim=1)), lr=0.1)
    assert not torch.allclose(whole, halves, rtol=1e-3)
    adam = [_stepped(torch.optim.AdamW, list(weight.chunk(n, dim=1)), list(grad.chunk(n, dim=1)), lr=0.1)
            for n in (1, 2)]
    torch.testing.assert_close(adam[0], adam[1], rtol=0, atol=0)


def _check(plan: str, optimizer_class, **keywords) -> None:
    program = fxpar.compile(build_model("gpt"), plan, example_inputs=global_batches()[0])
    require_elementwise_for_pieces(optimizer_class, program.stage_modules(0), lambda name: True,
                                   plan=program.plan, **keywords)


@pytest.mark.parametrize(("plan", "field", "named"), [
    ("tp=2", "tp", "S(0)"),             # the rows of a column-parallel weight
    ("dp=2 zero=3", "zero", "F"),       # a flat piece of every parameter
])
def test_an_optimizer_that_reads_whole_tensors_is_refused_where_parameters_are_split(plan, field, named):
    with pytest.raises(fxpar.PlanError) as error:
        _check(plan, torch.optim.Adafactor, elementwise=False)
    message = str(error.value)
    assert error.value.field == field and "Adafactor is not known to" in message and named in message
    assert "elementwise=True" in message and "Fix:" in message
    _check(plan, torch.optim.Adafactor, elementwise=True)  # vouched for: taken
    _check(plan, torch.optim.AdamW, elementwise=False)


def test_whole_parameters_take_any_optimizer():
    _check("dp=2", torch.optim.Adafactor, elementwise=False)
    _check("pp=2 mb=2", torch.optim.Adafactor, elementwise=False)
