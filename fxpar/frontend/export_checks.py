"""What `trace.capture` refuses or warns about in an exported program, besides state writes.

* `refuse_nested_graphs`: fxpar's passes work on one flat graph of aten ops, and export keeps
  a block that changes grad mode or autocast as a higher-order op calling a subgraph:

      submod_3 = self.submod_1
      mul = torch.ops.higher_order.wrap_with_autocast("cpu", torch.bfloat16, True, None, submod_3, x)
      getitem = mul[0]

  Grad-mode blocks are inlined before this check (`frontend.grad_regions`); what is left (an
  autocast block, a no_grad block inside another block, torch.cond) no pass can see into yet
  (and capture's unlifting would drop the subgraph), so such a model is refused naming the
  block and its module.
* `warn_fixed_sizes`: export specialises a dim of size 0 or 1 to a constant (a size of 1
  cannot be told from a broadcast), so an example batch of 1 fixes every step's batch at 1.

A forward that writes its own state is `fxpar.frontend.state_writes`.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.export import ExportedProgram

from fxpar.errors import CaptureError
from fxpar.ir.meta import exported_module_path

# What each region export wraps in a higher-order op stands for in the model's code.
_REGIONS = {
    "wrap_with_set_grad_enabled": "a `with torch.no_grad()` (or `torch.enable_grad()`) block inside another block",
    "wrap_with_autocast": "a `with torch.autocast(...)` block",
}
_DIM_NAMES = {0: "batch", 1: "sequence"}  # the dims capture makes symbolic


def refuse_nested_graphs(exported: ExportedProgram) -> None:
    """A CaptureError for the first block of forward that export keeps as a nested graph."""
    for node in exported.graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            name = node.target.name()
            what = _REGIONS.get(name, f"a {name} region (torch.cond, a loop, a checkpoint)")
            path = exported_module_path(node)
            where = f"module {path!r}" if path else "the root module's forward"
            raise CaptureError(
                f"the model's forward has {what} in {where}, which torch.export keeps as a "
                f"nested graph (torch.ops.higher_order.{name}) and fxpar does not capture yet. "
                "Fix: move that computation out of forward, or write it without the block: "
                "`.detach()` a result instead of computing it under torch.no_grad(), cast "
                "dtypes explicitly instead of autocasting"
            )


def warn_fixed_sizes(input_names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> None:
    """Warn, once, when an example input's batch or sequence dim has size 0 or 1."""
    for name, shape in zip(input_names, shapes):
        for dim, size in enumerate(shape[:2]):
            if size <= 1:
                what = _DIM_NAMES[dim]
                warnings.warn(
                    f"fxpar: example input {name!r} has size {size} in dim {dim} (the {what}); "
                    f"torch.export fixes sizes 0 and 1 as constants, so the captured graph "
                    f"runs with {what} {size} only and no plan can split it. Fix: capture with "
                    f"an example of {what} 2 or more (the {what} of one step)",
                    stacklevel=_first_caller_outside_fxpar(),
                )
                return


def _first_caller_outside_fxpar() -> int:
    """The `stacklevel` that names the user's line, whether fxpar.capture or fxpar.compile
    was called."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("fxpar"):
        frame, level = frame.f_back, level + 1
    return level
