"""Activation memory: the bytes autograd saves for backward, as a formula in batch and seq.

Rather than a table of what each op saves (which differs by kernel: PyTorch's CPU flash
attention saves a logsumexp where the math kernel saves the full attention matrix), fxpar
asks autograd itself. It runs the captured graph's forward once under export's own
`FakeTensorMode`, whose inputs have *symbolic* batch and sequence sizes, inside
`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd packs for backward passes
through the hook with a symbolic size. Storages are counted once (a saved view shares its
base's memory) and parameters are left out (they are counted as model state). The sum is an
exact formula, e.g. for a 2-layer GPT with h=32 on the CPU: 4944 batch seq + 8 seq + 4 bytes.

No tensor is allocated: a 96-layer GPT-3 runs in seconds on a laptop.

The saved bytes are not the whole of backward's memory: when backward starts, every saved
tensor is still alive and the loss's backward allocates its own tensors on top.
`backward_workspace_bytes` gives that term, W = 2 x the largest tensor the loss is computed
from: for cross-entropy over logits, the logits' gradient and the log-softmax gradient. It
was fitted on the example GPT on the CPU, where the measured peak of all nine configurations
is at the start of backward and this W accounts for it (RESULTS.md, "memory peak"). It is not
2 x the largest tensor of the graph: a GPT's MLP hidden (4h wide) is often larger than its
logits, but its gradient exists only once later layers have freed their saved tensors.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpar.trace import CapturedGraph


class _FakeStateInterpreter(fx.Interpreter):
    """Runs the graph with fake stand-ins for its parameters and buffers."""

    def __init__(self, gm: fx.GraphModule, state: dict[str, torch.Tensor]):
        super().__init__(gm)
        self.state = state

    def get_attr(self, target, args, kwargs):
        return self.state[target]


def saved_activation_bytes(captured: CapturedGraph) -> sympy.Expr:
    """Bytes saved for backward by one forward over the example's (symbolic) global batch."""
    gm = captured.graph_module
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(inputs)
    assert fake_mode is not None, "captured graphs carry export's fake tensors"
    real = dict(gm.named_parameters()) | dict(gm.named_buffers())
    getters = {n.target: n.meta["val"] for n in gm.graph.nodes if n.op == "get_attr"}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with fake_mode:
        state = {
            name: torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=value.device
            ).requires_grad_(bool(getattr(real.get(name), "requires_grad", False)))
            for name, value in getters.items()
        }
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            _FakeStateInterpreter(gm, state).run(*inputs)
    state_storages = {t.untyped_storage()._cdata for t in state.values()}
    seen: set[int] = set()
    total = sympy.Integer(0)
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage._cdata in state_storages or storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        total += captured.readable(storage.nbytes())
    return sympy.expand(total)


def backward_workspace_bytes(captured: CapturedGraph) -> sympy.Expr:
    """W: 2 x bytes of the largest tensor input of the op that computes the loss (module doc).

    A formula in the example's (global) batch and seq, like `saved_activation_bytes`.
    """
    gm = captured.graph_module
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0]
    if isinstance(loss, (tuple, list)):
        loss = loss[0]
    candidates = [sympy.Integer(0)]
    for node in loss.all_input_nodes if isinstance(loss, fx.Node) else ():
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            candidates.append(sympy.Mul(*captured.shape(node)) * value.dtype.itemsize)
    return 2 * sympy.Max(*candidates)
