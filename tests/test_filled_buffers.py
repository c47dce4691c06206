"""Capture writes a buffer filled slice by slice as the concatenation it is
(`fxpar.frontend.filled_buffers`), and leaves any other use of an empty tensor alone."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.frontend.trace import capture

X = torch.randn(4, 3, 8)


class _Filled(nn.Module):
    """A key built as DeepSeek-V3 builds it: a per-head part, and a part shared by every head
    broadcast into place (and cast: copy_ casts to the buffer's dtype)."""

    def __init__(self, tiled: bool = True):
        super().__init__()
        self.own, self.shared, self.tiled = nn.Linear(8, 12), nn.Linear(8, 2), tiled

    def forward(self, x, y):
        b, s, _ = x.shape
        own = self.own(x).view(b, s, 3, 4).transpose(1, 2)
        shared = self.shared(x).double().view(b, 1, s, 2)
        key = own.new_empty(b, 3, s, 6)
        key[:, :, :, :4] = own
        if self.tiled:
            key[:, :, :, 4:] = shared
        else:
            key[:, :, :, 4:] = 0.0  # a fill that is not a copy_: left for the passes
        return F.mse_loss(key.sum(-1).transpose(1, 2), y)


def targets(model: nn.Module) -> set:
    return {n.target for n in capture(model, (X, X[..., :3])).graph_module.graph.nodes}


def test_a_buffer_tiled_by_copies_becomes_a_cat_with_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = _Filled()
    graph = capture(model, (X, X[..., :3])).graph_module
    found = {n.target for n in graph.graph.nodes}
    assert torch.ops.aten.cat.default in found and torch.ops.aten.new_empty.default not in found
    loss = graph(X, X[..., :3])
    captured_grads = torch.autograd.grad(loss, list(graph.parameters()))
    expected = model(X, X[..., :3])
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    for got, want in zip(captured_grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_buffer_filled_otherwise_is_left_as_it_is():
    assert torch.ops.aten.new_empty.default in targets(_Filled(tiled=False))
