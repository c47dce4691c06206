"""The full state on every rank: whole tensors under the model's names, gathered from the ranks.

`Runner.full_state_dict()` and `Runner.full_gradients()` hand each stage module's local tensors
(its state dict, or its parameters' gradients) to `gather_full_tensors`, which

1. all-gathers tensor-parallel shards over the tp group and puts each whole tensor back
   together (`placement.global_tensor`, by the placement recorded on its parameter node);
2. copies every tensor to the CPU;
3. with a pipeline, all-gathers each rank's dict over the pp group (pickled: stages hold
   different keys and shapes) and merges them, keeping a tied parameter's first copy, in the
   order of the model's own `state_dict()`.

Every collective goes through the Communicator, tagged "full state: ...", so `comm_stats()`
counts it; it happens outside any step, so the step's `comm_log()` does not list it. It is
collective: every rank must call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.fx as fx

from fxpar import meta
from fxpar.mesh import Axis
from fxpar.placement import Shard, global_tensor
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import RankGroup


def gather_full_tensors(
    local: Iterable[tuple[fx.GraphModule, dict[str, torch.Tensor]]],
    *,
    groups: Mapping[Axis, RankGroup],
    communicator: Communicator,
    key_order: Iterable[str],
) -> dict[str, torch.Tensor]:
    """Whole CPU copies of every rank's `local` tensors (per stage module: name -> its local
    tensor), the same dict on every rank, ordered as `key_order` (the rest after)."""
    whole: dict[str, torch.Tensor] = {}
    for module, tensors in local:
        whole.update(_consolidate(module, tensors, groups.get(Axis.TP), communicator))
    return _across_pipeline(whole, groups.get(Axis.PP), communicator, key_order)


def _consolidate(
    module: fx.GraphModule,
    tensors: dict[str, torch.Tensor],
    tp: RankGroup | None,
    communicator: Communicator,
) -> dict[str, torch.Tensor]:
    """Whole CPU copies of `tensors`, gathering tensor-parallel shards over the tp group."""
    nodes = meta.parameter_nodes(module.graph)
    aliases = module.meta.get(meta.GRAPH_ALIASES, {})
    whole = {}
    for key, value in tensors.items():
        node = nodes.get(aliases.get(key, key))
        placement = meta.placement(node, "tp") if node is not None else None
        value = value.detach()
        if isinstance(placement, Shard) and tp is not None and tp.size > 1:
            pieces = communicator.all_gather_pieces(value, tp, tag=f"full state: tp shards of {key}")
            value = global_tensor(pieces, placement)
        whole[key] = value.to("cpu", copy=True)
    return whole


def _across_pipeline(
    tensors: dict[str, torch.Tensor],
    pp: RankGroup | None,
    communicator: Communicator,
    key_order: Iterable[str],
) -> dict[str, torch.Tensor]:
    if pp is None or pp.size == 1:
        return tensors
    merged: dict[str, torch.Tensor] = {}
    for piece in communicator.all_gather_dicts(tensors, pp, tag="full state: pipeline stages"):
        for key, value in piece.items():
            merged.setdefault(key, value)
    ordered = {k: merged[k] for k in key_order if k in merged}
    return ordered | {k: v for k, v in merged.items() if k not in ordered}
