"""The full state on every rank: whole tensors under the model's names, gathered from the ranks.

`Runner.full_state_dict()` and `Runner.full_gradients()` run the rank's state program
(`Program.state_program`, written by `full_state_lowering.lower_full_state`) over its stage modules'
local tensors (their state dicts, or their trained parameters' gradients):

0. GRADIENT_SHARDS, under ZeRO-1/2: each bucket's reduced gradient shards all-gathered over
   dp (`Runner.full_gradients` does it, from its buckets);
1. DP_SHARDS, under ZeRO-3: each parameter's flat dp pieces (`FlatShard`) all-gathered over dp
   and made its tensor-parallel piece again;
2. TP_SHARDS: each tensor-parallel shard all-gathered over the tp group and put back
   together (`placement.global_tensor`, by the placement on its parameter node); EP_SHARDS
   the same for an expert weight's shards over ep;
3. every tensor copied to the CPU;
4. STAGE_STATE, with a pipeline: each pipeline rank in turn broadcasts its whole tensors to
   its pp group, one flat buffer per dtype laid out as the action's `entries` say (shapes
   known at compile time, so nothing is pickled); a tied parameter keeps its first copy, and
   the result is ordered as the model's own `state_dict()`.

Every collective goes through the Communicator, held to the state program by a step guard
and counted in `comm_stats()`; it happens outside any step, so the step's `comm_log()` does
not list it. It is collective: every rank must call it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors

from fxpar.ir import meta
from fxpar.ir.mesh import Axis
from fxpar.ir.placement import FlatShard, R, global_tensor, local_shape
from fxpar.ir.step_program import Communicate, Purpose, StepProgram
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.state.parameter_groups import ParameterGroups
from fxpar.runtime.state.wrapped_optimizer import inner_optimizer
from fxpar.runtime.step.guard import StepGuard


def gather_full_tensors(
    program: StepProgram,
    local: Mapping[int, tuple[torch.fx.GraphModule, Mapping[str, torch.Tensor]]],
    *,
    groups: Mapping[Axis, RankGroup],
    communicator: Communicator,
    key_order: Iterable[str],
    gradient_shards: Callable[[Communicate], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Whole CPU copies of every rank's tensors (`local`: stage -> its module and its local
    tensors by name), the same dict on every rank, ordered as `key_order` (the rest after).
    `gradient_shards` runs a GRADIENT_SHARDS action (ZeRO: a bucket's reduced gradient
    gathered over dp) and returns the bucket's gradients by name, its stage's local tensors."""
    local = {stage: (module, dict(tensors)) for stage, (module, tensors) in local.items()}
    whole = {key: tensor.detach() for _, tensors in local.values() for key, tensor in tensors.items()}
    merged: dict[str, torch.Tensor] = {}
    guard = StepGuard(program)
    guard.start({})
    with communicator.held_to(guard):
        for action in program.actions:
            if action.purpose is Purpose.GRADIENT_SHARDS:
                gathered = gradient_shards(action)
                local[action.stage][1].update(gathered)
                whole.update({key: tensor.detach() for key, tensor in gathered.items()})
            elif action.purpose is Purpose.DP_SHARDS:
                module, tensors = local[action.stage]
                pieces = communicator.all_gather_pieces(tensors[action.name].detach(), groups[Axis.DP],
                                                        tag=action.calls[0].tag)
                node = _parameter_node(module, action.name)
                tensors[action.name] = whole[action.name] = global_tensor(
                    pieces, FlatShard(), local_shape(node.meta["val"].shape, meta.placements(node).on("dp", R),
                                                     _sizes(groups)))
            elif action.purpose is Purpose.TP_SHARDS:
                module, tensors = local[action.stage]
                pieces = communicator.all_gather_pieces(tensors[action.name].detach(), groups[Axis.TP],
                                                        tag=action.calls[0].tag)
                whole[action.name] = global_tensor(pieces, _tp_placement(module, action.name))
            elif action.purpose is Purpose.EP_SHARDS:  # after tp's: the experts' whole tensors
                module, _ = local[action.stage]
                pieces = communicator.all_gather_pieces(whole[action.name], groups[Axis.EP], tag=action.calls[0].tag)
                whole[action.name] = global_tensor(pieces, meta.placement(_parameter_node(module, action.name), "ep"))
            elif action.purpose is Purpose.STAGE_STATE:
                _receive_stage(action, whole, merged, groups[Axis.PP], communicator)
    if not merged:  # no pipeline: this rank holds everything
        merged = {key: tensor.to("cpu", copy=True) for key, tensor in whole.items()}
    ordered = {k: merged[k] for k in key_order if k in merged}
    return ordered | {k: v for k, v in merged.items() if k not in ordered}


def full_optimizer_state(optimizer, *, groups: ParameterGroups, modules, buckets, module_of_stage,
                         gather) -> dict[str, Any]:
    """`{"state": {name: {"exp_avg": whole tensor, ...}}, "param_groups": [{...options,
    "params": [names]}, ...]}`: an optimizer's state as `torch.optim` keeps it on one device
    over `groups` (`runtime.state.parameter_groups`), keyed by the parameters' names (every rank
    calls it).

    Each per-element state tensor, shaped as its parameter (or, under ZeRO-1/2, as this
    rank's shard of a flat bucket), travels as a gradient does: `gather(local, shards)` runs the
    gradients' state program (`Program.state_program(r, gradients=True)`) once per state key.
    A scalar (Adam's `step`) is this rank's, the same for every parameter stepped together;
    a parameter of the groups without state yet gets zeros, one outside them (another
    optimizer's) nothing."""
    from fxpar.runtime.state.master_weights import MixedPrecisionOptimizer
    from fxpar.runtime.state.sharded_optimizer import ShardedOptimizer

    inner = inner_optimizer(optimizer)
    sharded = isinstance(optimizer, ShardedOptimizer)
    # bf16-mixed: the state is the fp32 masters'.
    stepped = optimizer.master_of if isinstance(optimizer, MixedPrecisionOptimizer) else lambda p: p
    states = list(inner.state.values())
    keys = sorted({k for state in states for k, v in state.items() if v.dim() > 0})
    scalars = {k: v.detach().cpu().clone() for state in states for k, v in state.items() if v.dim() == 0}
    shard_states = [optimizer.shard_state(i) for i in range(len(optimizer.shards))] if sharded else []
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        if sharded:
            by_bucket = {(id(b), i): state[key] for (b, i, _), state in zip(optimizer.shards, shard_states)}

            def shards(action, by_bucket=by_bucket):
                owner = buckets[module_of_stage[action.stage]]
                return owner.whole_gradients(action.index, tag=action.calls[0].tag,
                                             shard=by_bucket[(id(owner), action.index)])

            # beside the shards, what it steps whole (an expert's weights under ep)
            local = {meta.stage_of(m): (m, {
                n: inner.state[t][key] if key in inner.state.get(t, {}) else torch.zeros_like(t)
                for n, t in optimizer.whole.items() if n in meta.parameter_nodes(m.graph)
            }) for m in modules}
        else:
            shards, local = None, {}
            for m in modules:
                trained = meta.trained_parameters(m)
                parameters = {n: m.get_parameter(n) for n in meta.parameter_nodes(m.graph) if n in trained}
                local[meta.stage_of(m)] = (m, {
                    n: inner.state[t][key] if key in inner.state.get(t, {}) else torch.zeros_like(t)
                    for n, t in ((n, stepped(p)) for n, p in parameters.items())
                })
        for name, tensor in gather(local, shards).items():
            whole.setdefault(name, {})[key] = tensor
    whole = {name: state for name, state in whole.items() if groups.group_of(name) is not None}
    for state in whole.values():
        state.update({k: v.clone() for k, v in scalars.items()})
    options = [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
    return {"state": whole, "param_groups": [o | {"params": list(names)} for o, names in zip(options, groups.names)]}


def _receive_stage(action, whole, merged, pp: RankGroup, communicator: Communicator) -> None:
    """One STAGE_STATE broadcast: pipeline rank `action.index` sends its tensors of one dtype."""
    (call,) = action.calls
    shapes = [torch.Size(shape) for _, shape in action.entries]
    if pp.index == action.index:
        flat = _flatten_dense_tensors([whole[key].to(call.dtype).reshape(shape)
                                       for (key, _), shape in zip(action.entries, shapes)])
    else:
        flat = torch.empty(call.numel, dtype=call.dtype, device=next(iter(whole.values())).device
                           if whole else "cpu")
    communicator.broadcast(flat, pp, tag=call.tag, source=action.index, log=False)
    pieces = flat.split([shape.numel() for shape in shapes])
    for (key, _), piece, shape in zip(action.entries, pieces, shapes):
        merged.setdefault(key, piece.view(shape).to("cpu", copy=True))


def _parameter_node(module: torch.fx.GraphModule, key: str) -> torch.fx.Node:
    """The parameter node behind state key `key` (a tied alias: its canonical's)."""
    aliases = meta.graph_aliases(module)
    return meta.parameter_nodes(module.graph)[aliases.get(key, key)]


def _tp_placement(module: torch.fx.GraphModule, key: str):
    """The tp placement of the parameter behind state key `key`."""
    return meta.placement(_parameter_node(module, key), "tp")


def _sizes(groups: Mapping[Axis, RankGroup]) -> dict[str, int]:
    return {axis.value: group.size for axis, group in groups.items()}
