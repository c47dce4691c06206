"""Step sizes: export's size symbols -> their values in one microbatch of the global batch.

Every payload formula of a step program (`fxpar.ir.step_program`) is written in export's size
symbols at the sizes of one microbatch of the *global* batch (a rank's piece of it follows from
the placements, `placement.local_shape`). Two places give those symbols values:

- `example_sizes`     at compile time, the example inputs' (`Program.example_sizes`: what
                      `collectives`, `check()` and the cost model read)
- `microbatch_sizes`  at run time, read back off a rank's piece of a step's microbatch
                      (`Program.microbatch_sizes`: what `runner.step` evaluates the guard at)
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from fxpar.frontend.trace import CapturedGraph
from fxpar.ir import meta
from fxpar.ir.placement import global_shape


def example_sizes(captured: CapturedGraph, *, microbatches: int) -> dict:
    """Export's size symbols -> their values in one of `microbatches` microbatches of the
    example's global batch (`batch` divided, every other symbol as the example has it)."""
    microbatch = captured.example_batch // microbatches
    sizes = {}
    for symbol, value in captured.example_sizes.items():
        for exported in captured.export_symbols(symbol.name):
            sizes[exported] = sympy.Integer(microbatch if symbol.name == "batch" else value)
    return sizes


def microbatch_sizes(
    graph_module: fx.GraphModule, microbatch: tuple[torch.Tensor, ...], mesh_sizes: dict[str, int]
) -> dict:
    """Export's size symbols -> their values in a step's microbatch of the global batch, read
    off this rank's piece of it (its inputs, in the graph's placeholder order):
    `placement.global_shape` undoes dp (and any other split of an input)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    sizes = {}
    for node, tensor in zip(placeholders, microbatch):
        whole = global_shape(tensor.shape, meta.placements(node), mesh_sizes)
        for dim, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                sizes[size.node.expr] = sympy.Integer(whole[dim])
    return sizes
