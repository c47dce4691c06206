"""What a compiled program offers the layers that read it, named in the core layer.

`fxpar.compiler.program` builds the program and prices it with cost/, and `Program.bind()` imports the
runtime; so neither cost/ nor the runtime imports the program module back
(tests/test_layers.py holds the package free of import cycles). They take the program as
data, and this Protocol lists that data. `fxpar.compiler.program.Program` is the one implementation.
"""

from __future__ import annotations

from typing import Protocol

import torch.fx as fx

from fxpar.frontend.trace import CapturedGraph
from fxpar.ir.mesh import Mesh
from fxpar.ir.step_program import StepProgram
from fxpar.plan.plan import Plan
from fxpar.plan.zero_reduction import ZeroReduction
from fxpar.schedule.schedules import Schedule


class CompiledProgram(Protocol):
    plan: Plan
    mesh: Mesh
    captured: CapturedGraph
    graph_module: fx.GraphModule  # the global graph after every pass
    stages: tuple | None  # ir.stages.Stage per pipeline stage, or None
    schedule: Schedule | None
    zero_reduce: ZeroReduction  # when ZeRO-2/3 reduce-scatter gradients (fxpar.plan.zero_reduction)

    @property
    def world_size(self) -> int: ...

    @property
    def buckets(self) -> tuple: ...

    @property
    def loss_reduction(self): ...

    @property
    def input_names(self) -> tuple[str, ...]: ...

    def holds_loss(self, rank: int) -> bool: ...

    def stage_modules(self, rank: int) -> list[fx.GraphModule]: ...

    def collectives(self, rank: int) -> tuple:
        """Every collective `rank` issues in one step (fxpar.ir.collectives.Collective)."""

    def step_program(self, rank: int, *, backend: str = "nccl", receives_ahead: int | None = None) -> StepProgram:
        """Everything `rank` does in one step, in order (fxpar.ir.step_program)."""

    def state_program(self, rank: int, *, gradients: bool = False) -> StepProgram:
        """What `rank` issues to gather the full state (or gradients) onto every rank."""

    def microbatch_sizes(self, microbatch: tuple) -> dict:
        """Export's size symbols at a step's microbatch of the global batch, from this rank's."""
