"""Rank specialisation: a stage's template GraphModule -> the one a given rank runs.

The last, pure step of compilation (docs/design.md, decision 2): `Program.stage_modules(rank)` copies
the template (global values, every rank's) and puts the rank and its mesh coordinate in the
copy's meta; each tensor-parallel parameter becomes a new Parameter holding this rank's slice
(`placement.local_slice` of its placements at the rank's coordinate), while replicated ones
stay the model's own tensors. Nothing touches a process group, so rank 517 of a 1024-rank plan
specialises on a laptop. Meta parameters slice to meta pieces: nothing is allocated.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.frontend.trace import restore_state_layout
from fxpar.ir import meta
from fxpar.ir.mesh import Mesh
from fxpar.ir.placement import local_slice
from fxpar.passes.infra import copy_graph_module


def specialise(graph_module: fx.GraphModule, rank: int, mesh: Mesh) -> fx.GraphModule:
    """A copy of `graph_module` for `rank`: its meta names the rank and coordinate, and every
    sliced parameter holds the rank's piece (the state dict keeps the model's keys)."""
    coord = mesh.coord(rank)
    module = copy_graph_module(graph_module)
    module.meta[meta.GRAPH_RANK] = rank
    module.meta[meta.GRAPH_COORD] = coord
    sliced = False
    for name, node in meta.parameter_nodes(module.graph).items():
        whole = module.get_parameter(name)
        piece = local_slice(whole.detach(), meta.placements(node), coord, mesh.sizes)
        if piece.shape != whole.shape:
            _replace_parameter(module, name, torch.nn.Parameter(piece.clone(), whole.requires_grad))
            sliced = True
    if sliced:
        restore_state_layout(module)
    return module


def _replace_parameter(module: torch.nn.Module, dotted: str, value: torch.nn.Parameter) -> None:
    owner_path, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    setattr(owner, leaf, value)
