"""Tier 1: a parameter or buffer replaced on the model after compile (a new object, not new
values) is a BindError at `program.bind()`, naming it and the fix, before any process group
exists; values copied into the captured tensors bind. One process, no torchrun."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar import BindError
import fxpar
from fxpar.frontend.replaced_state import check_state_not_replaced

IDS = torch.randint(0, 16, (4, 6))


class _TiedLM(nn.Module):
    """An embedding tied to its head (GPT-2's `lm_head.weight is wte.weight`), and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(8))

    def forward(self, ids, labels):
        return F.cross_entropy(self.head(self.embed(ids) * self.scale).flatten(0, 1), labels.flatten())


def compiled() -> tuple[_TiedLM, fxpar.Program]:
    model = _TiedLM()
    return model, fxpar.compile(model, "dp=1", (IDS, IDS.clone()))


def bind_refusal(program: fxpar.Program) -> str:
    with pytest.raises(BindError) as caught:
        program.bind()  # refused before it reads torchrun's environment
    return str(caught.value)


def test_a_parameter_replaced_after_compile_is_refused_with_its_name_and_the_fix():
    model, program = compiled()
    model.embed.weight = nn.Parameter(torch.zeros(16, 8))
    message = bind_refusal(program)
    assert message.startswith(
        "parameter 'embed.weight' is a new Parameter on the model, not the one fxpar.compile "
        "captured: the program reads the captured parameter, so the runner would train (and "
        "checkpoint) the old tensor while the model holds the new one. Fix: compile again after "
        "replacing"
    )
    assert "`with torch.no_grad(): model.get_submodule('embed').weight.copy_(new_value)`" in message


@pytest.mark.parametrize(
    "replace, named",
    [
        (lambda m: setattr(m.head, "weight", nn.Parameter(torch.zeros(16, 8))),
         "parameter 'head.weight' is a new Parameter"),  # a tie broken: the alias replaced
        (lambda m: setattr(m, "scale", torch.full((8,), 2.0)), "buffer 'scale' is a new tensor"),
        (lambda m: delattr(m, "scale"), "buffer 'scale' was deleted from the model"),
        (lambda m: setattr(m, "embed", nn.Embedding(16, 8)), "parameter 'embed.weight' is a new Parameter"),
    ],
    ids=["tied alias", "buffer", "deleted buffer", "module"],
)
def test_every_replaced_tensor_is_found(replace, named):
    model, program = compiled()
    replace(model)
    assert bind_refusal(program).startswith(named)


def test_several_replaced_tensors_are_counted():
    model, program = compiled()
    model.embed, model.scale = nn.Embedding(16, 8), torch.zeros(8)
    assert "(and 1 more: 'scale')" in bind_refusal(program)


def test_values_copied_into_the_captured_tensors_bind():
    model, program = compiled()
    with torch.no_grad():
        model.embed.weight.copy_(torch.zeros(16, 8))
    model.load_state_dict({"embed.weight": torch.ones(16, 8), "head.weight": torch.ones(16, 8), "scale": torch.ones(8)})
    check_state_not_replaced(program.captured)  # nothing replaced: bind goes on
    with pytest.raises(BindError, match="torchrun"):  # to read the (missing) torchrun environment
        program.bind()
