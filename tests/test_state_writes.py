"""Tier 1: a forward that writes state (BatchNorm in train mode, `buffer.add_`, a parameter
rescaled under no_grad) is refused at capture, naming the tensor, its module and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

from fxpar import CaptureError
import fxpar
from fxpar.frontend.state_writes import find_state_writes
from fxpar.frontend.trace import capture

X = torch.randn(8, 4)


class _Normed(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, **options))

    def forward(self, x, y):
        return F.mse_loss(self.block(self.proj(x)), y)


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x, y):
        self.steps.add_(1)
        return F.mse_loss(self.proj(x), y)


class _WritesThroughAView(_Counter):
    def __init__(self):
        super().__init__()
        self.register_buffer("average", torch.zeros(4))

    def forward(self, x, y):
        h = self.proj(x)
        self.average.view(-1)[0:2].copy_(h.detach().mean(0)[:2])
        return F.mse_loss(h, y)


class _RescalesItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, y):
        with torch.no_grad():
            self.proj.weight.mul_(0.5)
        return F.mse_loss(self.proj(x), y)


class _NoGradBlock(_RescalesItsWeight):
    def forward(self, x, y):
        with torch.no_grad():
            scale = x.abs().mean()
        return F.mse_loss(self.proj(x) * scale, y)


def refusal(model: nn.Module) -> str:
    with pytest.raises(CaptureError) as caught:
        capture(model, (X, X.clone()))
    return str(caught.value)


def test_batch_norm_in_train_mode_names_the_buffer_its_module_and_the_fix():
    model = _Normed()
    before = model.block[1].running_mean.clone()
    message = refusal(model)
    assert message.startswith(
        "the model writes buffer 'block.1.running_mean' of module 'block.1' (BatchNorm1d) in "
        "place during forward (aten.batch_norm.default in training mode, in module 'block.1') "
        "(and 2 more: 'block.1.running_var', 'block.1.num_batches_tracked')."
    )
    assert "every rank would update its own running statistics" in message
    assert "Fix: put the module in eval mode before capture (`model.get_submodule('block.1').eval()`" in message
    assert "track_running_stats=False" in message and "SyncBatchNorm is not supported" in message
    assert torch.equal(model.block[1].running_mean, before)  # the refusal changed nothing


def test_batch_norm_that_writes_nothing_is_captured():
    eval_mode = _Normed()
    eval_mode.block[1].eval()
    for model in (eval_mode, _Normed(track_running_stats=False)):
        captured = capture(model, (X, X.clone()))
        torch.testing.assert_close(captured.graph_module(X, X), model(X, X))


def test_batch_statistics_under_a_split_batch_warn_at_compile():
    # Without running statistics BatchNorm writes nothing, but a split batch changes its math.
    with pytest.warns(UserWarning, match=r"module 'block.1' normalises with the statistics of its "
                      r"input batch.*splits each batch into 2 pieces"):
        fxpar.compile(_Normed(track_running_stats=False), "dp=2", example_inputs=(X, X.clone()))
    eval_mode = _Normed()
    eval_mode.block[1].eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*normalise with the statistics")
        fxpar.compile(eval_mode, "dp=2", example_inputs=(X, X.clone()))
        fxpar.compile(_Normed(track_running_stats=False), "dp=1", example_inputs=(X, X.clone()))


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (_Counter(), "writes buffer 'steps' of the root module (_Counter) in place during forward "
                     "(aten.add_.Tensor, in the root module's forward)"),
        (_WritesThroughAView(), "writes buffer 'average' of the root module (_WritesThroughAView) "
                                "in place during forward (aten.copy_.default"),
    ],
)
def test_a_buffer_written_in_place_is_refused(model, expected):
    message = refusal(model)
    assert expected in message
    assert "drift apart silently" in message and "Fix: update the tensor outside forward" in message


def test_a_parameter_written_under_no_grad_names_the_parameter_and_module():
    model = _RescalesItsWeight()
    before = model.proj.weight.detach().clone()
    message = refusal(model)
    assert message.startswith(
        "the model writes parameter 'proj.weight' of module 'proj' (Linear) in place during "
        "forward (aten.mul_.Tensor under torch.no_grad(), in the root module's forward)."
    )
    assert "Fix: change parameters outside forward" in message
    assert torch.equal(model.proj.weight, before)


def test_a_no_grad_block_without_writes_is_captured_on_detached_inputs():
    """Its ops inline, reading detached copies: the loss is the model's, and no gradient flows
    through the block (the multi-rank training is tests/runtime/test_no_grad_blocks.py)."""
    model = _NoGradBlock()
    graph = capture(model, (X, X.clone())).graph_module
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.higher_order.wrap_with_set_grad_enabled not in targets
    assert targets[:3] == [torch.ops.aten.detach.default, torch.ops.aten.abs.default, torch.ops.aten.mean.default]
    torch.testing.assert_close(graph(X, X.clone()), model(X, X.clone()), rtol=0, atol=0)


class _AutocastBlock(_RescalesItsWeight):
    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.proj(x)
        return F.mse_loss(h.float(), y)


def test_an_autocast_block_is_refused_as_a_nested_graph():
    message = refusal(_AutocastBlock())
    assert "has a `with torch.autocast(...)` block in the root module's forward" in message
    assert "torch.ops.higher_order.wrap_with_autocast" in message and "Fix: " in message


def test_writes_recorded_in_the_signature_are_found_too():
    # A functionalised program (what export returned before the training IR) records the
    # write as a BUFFER_MUTATION output instead of an in-place op.
    dynamic = ({0: Dim.AUTO}, {0: Dim.AUTO})
    exported = torch.export.export(_Counter(), (X, X.clone()), dynamic_shapes=dynamic, strict=False)
    functional = exported.run_decompositions({})
    assert [w.name for w in find_state_writes(functional)] == ["steps"]
    assert [(w.kind, w.name, w.op) for w in find_state_writes(exported)] == [
        ("buffer", "steps", "aten.add_.Tensor")
    ]


@pytest.mark.parametrize("options, norm", [({"momentum": None}, nn.BatchNorm1d), ({}, nn.SyncBatchNorm)])
def test_every_batch_norm_in_train_mode_is_refused_by_module_and_buffer(options, norm):
    # momentum=None (a cumulative average) cannot even be exported: its step counter becomes a
    # Python float. The refusal names the module, not export's guard error. Issue 13 saw a
    # BatchNorm in train mode train silently per rank under dp=2; every form is refused now.
    model = _Normed()
    model.block[1] = norm(4, **options)
    with pytest.raises(CaptureError) as error:
        fxpar.compile(model, "dp=2", example_inputs=(X, X.clone()))
    message = str(error.value)
    assert message.startswith(
        f"the model writes buffer 'block.1.running_mean' of module 'block.1' ({norm.__name__}) in "
        "place during forward"
    )
    assert "Fix: put the module in eval mode before capture" in message
