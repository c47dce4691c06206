"""ZeRO-3 at bind: every replica's parameter pieces cut from the first replica's values.

A ZeRO-3 rank holds only its `FlatShard` piece of each trained parameter on the dp axis
(`passes.zero3`), so the broadcast that makes replicas start equal (DDP's, at construction)
cannot send the pieces themselves: they differ by rank. The first dp rank broadcasts each
parameter's tensor-parallel piece whole instead (one flat buffer per dtype, the same bytes
DDP's broadcast moves), and every rank cuts its own piece from it with `placement.local_slice`,
the function that cut it at rank specialisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxpar.ir import meta
from fxpar.ir.placement import FlatShard, R, local_slice


def dp_sharded_parameters(modules) -> dict[int, tuple[torch.fx.GraphModule, str]]:
    """id(parameter) -> (its module, its name), for each parameter FlatShard on dp."""
    sharded = {}
    for module in modules:
        for name, node in meta.parameter_nodes(module.graph).items():
            if isinstance(meta.placement(node, "dp"), FlatShard):
                sharded[id(module.get_parameter(name))] = (module, name)
    return sharded


def broadcast_sharded_parameters(program, modules, rank: int, dp, broadcast: Callable) -> None:
    """Overwrite this rank's pieces with the first dp rank's values, cut for this rank."""
    coord = program.mesh.coord(rank)
    sizes = program.mesh.sizes
    entries = []
    for module in modules:
        template = program.stage_template(meta.stage_of(module))
        for name, node in meta.parameter_nodes(module.graph).items():
            placements = meta.placements(node)
            if isinstance(placements.dp, FlatShard):
                whole = local_slice(template.get_parameter(name).detach(), placements.on("dp", R), coord, sizes)
                entries.append((module.get_parameter(name), whole.to(module.get_parameter(name).device, copy=True),
                                placements))
    broadcast([whole for _, whole, _ in entries], dp)
    with torch.no_grad():
        for parameter, whole, placements in entries:
            parameter.copy_(local_slice(whole, placements.on("tp", R), coord, sizes))
