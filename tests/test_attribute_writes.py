"""Tier 1: a forward that changes a Python attribute of a module (`self.steps += 1`, a list
appended to, a config field, `self.eval()`, a plain tensor reassigned) is refused at capture, naming the module, the
attribute, its value before and after forward, and the fix; one that only reads them is not.
(The Hugging Face models capture unrefused in tests/test_hf_capture.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar import CaptureError
from fxpar.frontend.attribute_writes import changed_attributes, fingerprint_attributes
from fxpar.frontend.trace import capture

X = torch.randn(8, 4)


class _Stateful(nn.Module):
    """Reads Python state of every kind in forward; `write` (a test's lambda) changes some."""

    def __init__(self, write=lambda model, x: None):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.steps, self.mode, self.history = 0, "train", list(range(100))
        self.config = SimpleNamespace(scale=2, layers={"kinds": ["dense"]})
        self.total = torch.zeros(())  # a plain tensor attribute, not a buffer
        self.write = write

    def forward(self, x, y):
        self.write(self, x)
        h = self.block(x) * self.config.scale
        if self.steps > 1000 and self.mode == "train" and len(self.history) > 5:
            h = h * 2  # a branch on Python state: capture takes it as it finds it
        return F.mse_loss(h, y)


def refusal(write) -> str:
    with pytest.raises(CaptureError) as caught:
        capture(_Stateful(write), (X, X.clone()))
    return str(caught.value)


def test_a_counter_updated_in_forward_is_refused_with_its_module_values_and_fix():
    def count(model, x):
        model.steps += 1

    message = refusal(count)
    assert message.startswith(
        "the model's forward changes attribute 'steps' of the root module (_Stateful): it held 0 "
        "when forward started and held 1 when it returned. A captured graph holds the Python values "
        "forward reads as constants"
    )
    assert "(a branch on it always taken the same way)" in message
    assert "Fix: keep Python state out of forward" in message and "compile again" in message


@pytest.mark.parametrize(
    "write, named",
    [
        (lambda m, x: m.history.append(1), "'history' of the root module (_Stateful): it held a list of 100 items when forward started and held a list of 101 items"),
        (lambda m, x: m.history.__setitem__(3, -1), "'history[3]' of the root module (_Stateful): it held 3 when forward started and held -1"),
        (lambda m, x: setattr(m.config, "scale", 3), "'config.scale' of the root module (_Stateful): it held 2 when forward started and held 3"),
        (lambda m, x: m.config.layers["kinds"].append("moe"), "\"config.layers['kinds']\" of the root module (_Stateful): it held a list of 1 item when"),
        (lambda m, x: setattr(m, "mode", "eval"), "'mode' of the root module (_Stateful): it held 'train' when forward started and held 'eval'"),
        (lambda m, x: m.block[0].eval(), "'training' of module 'block.0' (Linear): it held True when forward started and held False"),
        (lambda m, x: setattr(m.block[1], "seen", x.shape[0]), "'seen' of module 'block.1' (ReLU): it was not set when forward started and held a SymInt object"),
        (lambda m, x: setattr(m, "total", m.total + x.sum()), "'total' of the root module (_Stateful): it held a Tensor object when forward started and held another Tensor object"),
    ],
    ids=["list appended", "list item", "config field", "nested list", "string", "eval()", "new attribute", "tensor"],
)
def test_every_kind_of_python_state_written_is_named_to_the_item(write, named):
    assert f"the model's forward changes attribute {named}" in refusal(write)


def test_several_writes_name_the_first_and_count_the_others():
    def several(model, x):
        model.steps, model.mode, model.block[0].note = 1, "eval", "seen"

    assert "(and 2 more: mode, block.0.note)" in refusal(several)


def test_a_forward_that_only_reads_or_sets_what_was_there_is_captured():
    def same_again(model, x):
        model.mode, model.config.scale = "train", 2  # equal values: no change

    captured = capture(_Stateful(same_again), (X, X.clone()))
    assert captured.graph_module(X, X.clone()).shape == ()


def test_fingerprints_compare_long_containers_by_length_and_first_items():
    model = _Stateful()
    model.history = list(range(10_000))
    before = fingerprint_attributes(model)
    model.history[5_000] = -1  # past the items compared: not seen
    assert changed_attributes(model, before, fingerprint_attributes(model)) == []
    model.history.append(0)
    (write,) = changed_attributes(model, before, fingerprint_attributes(model))
    assert (write.attribute, write.before, write.after) == ("history", "a list of 10000 items", "a list of 10001 items")
