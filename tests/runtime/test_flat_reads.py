"""The executors' forward reads the rank module's own tensors by flat names."""

import torch
import torch.fx as fx

from fxpar.runtime.flat_reads import reading_flat


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.up(self.norm(x)) * self.scale


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.h = torch.nn.ModuleList([Block(), Block()])
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.h[0](x)).sum() + self.h[1](x).sum()


def test_the_flat_forward_computes_the_same_and_trains_the_same_parameters():
    torch.manual_seed(0)
    module = torch.export.export(Model(), (torch.randn(3, 8),)).module()
    module = fx.GraphModule(module, module.graph)  # a plain GraphModule, as a rank module is
    forward = reading_flat(module)
    x = torch.randn(3, 8)

    assert "getattr(" not in forward.code and "getattr(" in module.code
    assert list(forward.parameters()) == []  # the rank module alone registers them
    assert torch.equal(forward(x), module(x))

    forward(x).backward()  # gradients land on the rank module's own parameters
    assert all(p.grad is not None for p in module.parameters())
    with torch.no_grad():  # .data changes (ZeRO's flat buffers, device moves) are seen
        module.get_parameter("down.bias").data = torch.full((8,), 2.0)
    assert torch.equal(forward(x), module(x))
