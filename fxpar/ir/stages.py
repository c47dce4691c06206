"""Pipeline stages as data: a stage's graph and the tensors that cross into and out of it.

`passes.pipeline.split_stages` makes them; the pipeline program, the lowering (each transfer's
shape and dtype) and the runtime's pipeline executor read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.buckets import Bucket
from fxpar.ir.placement import Placements


@dataclass(frozen=True)
class Boundary:
    """A tensor that crosses into a stage: its name there, global shape, dtype, placements."""

    name: str
    shape: tuple  # sympy expressions in export's symbols (global: the whole microbatch, unsharded)
    dtype: torch.dtype
    requires_grad: bool
    placement: Placements  # on each mesh axis: a rank's piece is `placement.local_shape`


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its graph, what crosses into and out of it, the inputs it reads."""

    index: int
    graph_module: fx.GraphModule
    inputs: tuple[Boundary, ...]  # tensors received from the previous stage
    outputs: tuple[Boundary, ...]  # tensors sent to the next stage (the next stage's inputs)
    user_inputs: tuple[str, ...]  # names of the step's inputs this stage reads

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Its gradient buckets, once `passes.data_parallel` ran on it."""
        return meta.graph_buckets(self.graph_module)

    def parameter_names(self) -> list[str]:
        return list(meta.parameter_nodes(self.graph_module.graph))
