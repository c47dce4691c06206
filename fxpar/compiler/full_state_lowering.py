"""Full-state lowering: what gathering the whole model (or its gradients) onto every rank issues.

`lower_full_state` writes the actions of `runner.full_state_dict()` and
`runner.full_gradients()` (`Program.state_program`), outside a step: each dp shard
(ZeRO-3's flat pieces, ZeRO-1/2's gradient buckets), each tensor-parallel shard and each
expert-parallel shard all-gathered whole, then, with a pipeline, each pipeline rank's whole
tensors broadcast to its group, one flat buffer per dtype. Every rank knows every stage's tensors and shapes at compile
time, so nothing is pickled and the calls are known exactly. The step's own actions are
`fxpar.compiler.lowering`'s.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.placement import FlatShard, R, local_numel
from fxpar.ir.step_program import StepAction, Call, Communicate, Purpose


def lower_full_state(program, pp: int, *, gradients: bool) -> tuple[StepAction, ...]:
    """The actions of gathering the full state on pipeline rank `pp`'s ranks (module doc):
    the state dict (parameters and persistent buffers), or each trained parameter's gradient."""
    mesh = program.mesh
    rows = {q: _state_entries(program, q, gradients=gradients) for q in range(mesh.pp)}
    actions: list[StepAction] = []
    if gradients and program.plan.zero in (1, 2) and mesh.dp > 1:  # each rank holds a shard
        for stage, gm in _local_graphs(program, pp):
            nodes = meta.parameter_nodes(gm.graph)
            for b in meta.graph_buckets(gm):
                # Gathered in the masters' dtype under bf16-mixed, as the tensors they become.
                dtype = meta.master_dtype(nodes[b.parameters[0]]) or b.reduced_dtype
                call = Call(kind="all_gather", numel=b.padded(mesh.dp), dtype=dtype, axis="dp",
                            op="none", tag=f"full state: gradient bucket {b.index}", phase="step")
                actions.append(Communicate(Purpose.GRADIENT_SHARDS, (call,), stage=stage, index=b.index))
    for stage, key, node, value in rows[pp]:
        if mesh.dp > 1 and node is not None and isinstance(meta.placement(node, "dp"), FlatShard):
            call = Call(kind="all_gather", numel=local_numel(value.shape, meta.placements(node), mesh.sizes) * mesh.dp,
                        dtype=value.dtype, axis="dp", op="none", tag=f"full state: dp shards of {key}", phase="step")
            actions.append(Communicate(Purpose.DP_SHARDS, (call,), stage=stage, name=key))
        if mesh.tp > 1 and node is not None and meta.placement(node, "tp") != R:
            # whole on tp (and dp, gathered first), still split on ep where an expert weight is
            # (gathered over ep next)
            tp_whole = local_numel(value.shape, meta.placements(node).on("tp", R).on("dp", R), mesh.sizes)
            call = Call(kind="all_gather", numel=tp_whole, dtype=value.dtype, axis="tp", op="none",
                        tag=f"full state: tp shards of {key}", phase="step")
            actions.append(Communicate(Purpose.TP_SHARDS, (call,), stage=stage, name=key))
        if mesh.ep > 1 and node is not None and meta.placement(node, "ep") != R:
            call = Call(kind="all_gather", numel=value.numel(), dtype=value.dtype, axis="ep", op="none",
                        tag=f"full state: ep shards of {key}", phase="step")
            actions.append(Communicate(Purpose.EP_SHARDS, (call,), stage=stage, name=key))
    for q in range(mesh.pp if mesh.pp > 1 else 0):
        by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
        for _, key, _, value in rows[q]:
            by_dtype.setdefault(value.dtype, []).append((key, tuple(value.shape)))
        for dtype, entries in by_dtype.items():
            numel = sum(math.prod(shape) for _, shape in entries)
            call = Call(kind="broadcast", numel=numel, dtype=dtype, axis="pp", op="none",
                        tag=f"full state: pipeline rank {q} ({dtype})", phase="step")
            actions.append(Communicate(Purpose.STAGE_STATE, (call,), index=q, entries=tuple(entries)))
    return tuple(actions)


def _state_entries(program, pp: int, *, gradients: bool) -> list[tuple[int, str, fx.Node | None, torch.Tensor]]:
    """(stage, key, its parameter node or None, its global value) of every tensor the ranks of
    pipeline rank `pp` hold, in stage then state-dict order: the state dict's keys, or for
    gradients the trained parameters (those in a gradient bucket)."""
    entries = []
    for stage, gm in _local_graphs(program, pp):
        nodes = meta.parameter_nodes(gm.graph)
        aliases = meta.graph_aliases(gm)
        if gradients:
            trained = meta.trained_parameters(gm)
            tensors = {name: gm.get_parameter(name) for name in nodes if name in trained}
        else:
            tensors = gm.state_dict(keep_vars=True)
        for key, value in tensors.items():
            node = nodes.get(aliases.get(key, key))
            if (master := meta.master_dtype(node)) is not None:  # gathered as its fp32 master
                value = torch.empty(value.shape, dtype=master, device="meta")
            entries.append((stage, key, node, value))
    return entries


def _local_graphs(program, pp: int) -> list[tuple[int, fx.GraphModule]]:
    """(stage, graph) of each stage pipeline rank `pp` holds (the one graph without a pipeline)."""
    if program.stages is None:
        return [(0, program.graph_module)]
    return [(s.index, s.graph_module) for s in program.stages if program.schedule.rank_of(s.index) == pp]
