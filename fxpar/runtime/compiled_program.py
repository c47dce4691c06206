"""What the runtime reads of a compiled program, named rather than imported.

`Program.bind()` imports the runtime to create this rank's Runner, so the runtime does not
import the program back (tests/test_layers.py holds the package free of import cycles): it
takes the program as data, and this Protocol lists what it reads. `fxpar.program.Program` is
the one implementation.
"""

from __future__ import annotations

from typing import Protocol

import torch.fx as fx

from fxpar.mesh import Mesh
from fxpar.plan import Plan
from fxpar.schedules import Schedule
from fxpar.trace import CapturedGraph


class CompiledProgram(Protocol):
    plan: Plan
    mesh: Mesh
    captured: CapturedGraph
    stages: tuple | None  # passes.pipeline.Stage per pipeline stage, or None
    schedule: Schedule | None

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
