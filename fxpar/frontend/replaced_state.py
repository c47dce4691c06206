"""Parameters and buffers replaced on the model after capture, refused at `Program.bind`.

`fxpar.compile` copies nothing: the program's graph reads the model's own `Parameter` and
buffer objects (`trace.capture`), and the runner trains exactly those. Assigning a new tensor
to the model afterwards,

    program = fxpar.compile(model, "dp=2", (tokens, labels))
    model.fc.weight = nn.Parameter(pretrained)      # a new Parameter object
    runner = program.bind()                         # BindError: 'fc.weight' was replaced

rebinds the model's attribute and nothing else: the runner would train the tensor it captured,
while the user's own optimizer, checkpoint or evaluation reads the new one that never changes.
`check_state_not_replaced` finds this at bind, before any process group exists, comparing the
model's tensors by identity with the ones the capture holds, each parameter (tied names too),
and each buffer. Values copied into the captured tensors are fine, and are what training from
pretrained weights should do: `load_state_dict`, or `with torch.no_grad(): p.copy_(value)`.

The check walks every parameter name once, so it runs at bind only, not at every step: a
tensor replaced after bind is not found (the runner keeps training the one it bound).
"""

from __future__ import annotations

import torch

from fxpar.errors import BindError
from fxpar.frontend.trace import CapturedGraph


def check_state_not_replaced(captured: CapturedGraph) -> None:
    """Raise BindError naming the first parameter or buffer of the model that is no longer the
    tensor `captured` holds (a new object assigned, or deleted), and the fix."""
    model = captured.model
    parameters = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    expected = [("parameter", name, p, parameters) for name, p in captured.parameters.items()]
    expected += [("parameter", alias, captured.parameters[name], parameters) for alias, name in captured.aliases.items()
                 if name in captured.parameters]
    expected += [("buffer", name, b, buffers) for name, b in captured.buffers.items()]
    replaced = [(kind, name, found.get(name)) for kind, name, tensor, found in expected if found.get(name) is not tensor]
    if not replaced:
        return
    kind, name, now = replaced[0]
    others = [n for _, n, _ in replaced[1:]]
    listed = ", ".join(repr(n) for n in others[:4]) + (", ..." if len(others) > 4 else "")
    also = f" (and {len(others)} more: {listed})" if others else ""
    what = "was deleted from the model" if now is None else (
        f"is a new {_kind_of(now)} on the model, not the one fxpar.compile captured")
    owner, _, leaf = name.rpartition(".")
    target = f"model.get_submodule({owner!r}).{leaf}" if owner else f"model.{leaf}"
    raise BindError(
        f"{kind} {name!r} {what}{also}: the "
        f"program reads the captured {kind}, so the runner would train (and checkpoint) the old "
        f"tensor while the model holds the new one. Fix: compile again after replacing "
        f"(fxpar.compile(model, ...) captures anew; an earlier fxpar.capture holds the old "
        f"tensor too), or copy the new values into the captured {kind} instead of replacing it: "
        f"`with torch.no_grad(): {target}.copy_(new_value)` (or model.load_state_dict)"
    )


def _kind_of(tensor: torch.Tensor) -> str:
    return "Parameter" if isinstance(tensor, torch.nn.Parameter) else "tensor"
