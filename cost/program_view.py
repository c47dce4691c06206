"""What the cost model reads of a compiled program, named rather than imported.

The cost layer sits below the program layer (docs/architecture.md): `fxpar.program` prices
plans with cost/, so cost/ cannot import it back. It takes the program as data instead, and
this Protocol lists the data it reads; `fxpar.program.Program` is the one implementation.
"""

from __future__ import annotations

from typing import Protocol

import torch.fx as fx

from fxpar.mesh import Mesh
from fxpar.plan import Plan
from fxpar.schedules import Schedule
from fxpar.trace import CapturedGraph


class ProgramView(Protocol):
    plan: Plan
    mesh: Mesh
    captured: CapturedGraph
    graph_module: fx.GraphModule  # the global graph after every pass
    stages: tuple | None  # passes.pipeline.Stage per pipeline stage, or None
    schedule: Schedule | None

    @property
    def world_size(self) -> int: ...

    @property
    def buckets(self) -> tuple: ...

    def collectives(self, rank: int) -> tuple:
        """Every collective `rank` issues in one step (fxpar.collectives.Collective)."""
