"""The tensors that cross each pipeline cut, matched to the global graph's nodes.

A pipeline stage's graph (`passes.pipeline.split_stages`) takes the tensors crossing into it
as placeholders `boundary_0`, `boundary_1`, ..., described by `Stage.inputs`; each placeholder
carries the meta of the global node it stands for, its value (`meta["val"]`) included. The
picture draws one send/recv box per crossing, between the box that makes the value and the
boxes that read it, so it needs the global node of each boundary: the one with that value.

A value made in stage 0 and read in stage 2 crosses two cuts (stage 1 passes it on): it has
a crossing into stage 1 and one into stage 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fxpar.ir.compiled_program import CompiledProgram


@dataclass(frozen=True)
class Crossing:
    """One tensor received by `stage` from `stage - 1`; `node` is None when no global node
    holds its value (the boundary is drawn without a source)."""

    node: fx.Node | None
    stage: int
    boundary: object  # passes.pipeline.Boundary: shape, dtype, requires_grad, placement

    @property
    def key(self) -> tuple:
        return (self.node if self.node is not None else self.boundary, self.stage)

    @property
    def source_stage(self) -> int:
        return self.stage - 1


def crossings(program: CompiledProgram) -> dict[tuple, Crossing]:
    """Every crossing of `program`'s cuts, keyed by (global node, receiving stage)."""
    by_value = {id(n.meta["val"]): n for n in program.graph_module.graph.nodes if "val" in n.meta}
    found = {}
    for stage in program.stages or ():
        placeholders = [n for n in stage.graph_module.graph.nodes if n.op == "placeholder"]
        for boundary in stage.inputs:
            placeholder = next((p for p in placeholders if p.name == boundary.name), None)
            value = placeholder.meta.get("val") if placeholder is not None else None
            crossing = Crossing(by_value.get(id(value)), stage.index, boundary)
            found[crossing.key] = crossing
    return found
