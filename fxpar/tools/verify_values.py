"""Node values for `fxpar.verify`: recorded where a graph runs, made whole from the ranks' pieces.

Recording. `NodeRecorder.install(gm, names)` adds a submodule to a GraphModule and a call to it
after each node named in `names`: each call keeps a copy of the node's value (one per
microbatch, in the order the module runs them) and hooks the value's gradient. Copies are taken
as the value is made, so an all-reduce that later reuses the tensor's memory in place
(`ops.distributed.lower_for_eager`) does not change what was recorded. The one-device reference
and every rank's stage modules record the same way; node names are what joins them (the passes
keep the captured graph's names, `passes.infra.copy_graph_module`).

Reassembly. A rank holds one piece of a node's value per microbatch; `whole_value` puts the
pieces back into the one-device value with the node's placements, the same facts that cut them
(`fxpar.ir.placement`: `global_tensor` inverts `local_slice`):

    tp   Shard(d): the tp ranks' pieces joined (`global_tensor`); Partial: summed;
         Replicate: rank 0's piece, the others compared with it (`spread`)
    cp   the same over the cp ranks, each piece whole over tp first: a slice of the
         sequence joined, a sum over the tokens summed, a whole value compared
    dp   the dp ranks' microbatches in batch order, rank by rank (`Runner.local_batch` splits
         the batch by rank, then by microbatch): joined along the batch dim for Shard(d),
         summed for Partial, compared for Replicate; a ZeRO-3 parameter's FlatShard pieces
         joined first, inside each tp piece, as `local_slice` cut them last
    ep   an expert weight's pieces joined over the first expert group's ranks, the other
         groups' compared with them

A pipeline stage's values are on the pipeline rank that holds the stage (a parameter read by
several stages is taken from the first). A gradient's placement is the dual of its value's:
a Shard's gradient is sharded alike, a Partial's is replicated, and a value replicated over dp
(or cp) gets a summand from each piece (`gradient_placements`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.fx as fx

from fxpar.ir.mesh import Mesh
from fxpar.ir.placement import (
    AXES, FlatShard, Partial, Placement, Placements, Replicate, Shard, global_tensor, local_shape,
)
from fxpar.runtime.step.valid_targets import ARRIVED

RECORDER = "fxpar_verify_recorder"  # the submodule's name in a recorded GraphModule


class NodeRecorder(torch.nn.Module):
    """Keeps the values (per microbatch) and gradients of the nodes it is installed after."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, list[torch.Tensor]] = {}
        self.grads: dict[str, dict[int, torch.Tensor]] = {}

    @classmethod
    def install(cls, gm: fx.GraphModule, names: set[str]) -> NodeRecorder:
        """Record every node of `gm` named in `names` (placeholders, parameters, computed
        values) whose value is a tensor; returns the recorder. Recompiles `gm`."""
        recorder = cls()
        gm.add_submodule(RECORDER, recorder)
        for node in list(gm.graph.nodes):
            if node.name not in names or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            # A bound rank's count of valid targets arrives during the forward: its value is
            # the one after the wait the runtime put in (`runtime.step.valid_targets`).
            value = next((u for u in node.users if u.name == ARRIVED), node)
            with gm.graph.inserting_after(value):
                gm.graph.call_module(RECORDER, (node.name, value))
        gm.recompile()
        return recorder

    def forward(self, name: str, value: torch.Tensor) -> None:
        microbatch = len(self.values.setdefault(name, []))
        self.values[name].append(value.detach().clone())
        if value.requires_grad:
            value.register_hook(partial(self._gradient, name, microbatch))

    def _gradient(self, name: str, microbatch: int, grad: torch.Tensor | None) -> None:
        # None: no gradient flows to the value through autograd. ZeRO-3's parameter pieces get
        # theirs from the gatherer instead (`runtime.state.parameter_gatherer`); parameter gradients
        # are compared after the step, from `.grad` (`fxpar.verify`).
        if grad is not None:
            self.grads.setdefault(name, {})[microbatch] = grad.detach().clone()


@dataclass(frozen=True)
class Pieces:
    """What one rank recorded of one node: its placements and its pieces per microbatch."""

    placements: Placements
    values: tuple[torch.Tensor, ...]


def gradient_placements(placements: Placements) -> Placements:
    """Where a value's gradient lies, given where the value does (module doc)."""
    def dual(axis: str, placement: Placement) -> Placement:
        if isinstance(placement, Partial):
            return Replicate()
        if isinstance(placement, Replicate) and axis in ("dp", "cp"):
            return Partial()  # each piece of the batch (or of the sequence) adds its share
        return placement
    return Placements(**{axis: dual(axis, placements[axis]) for axis in AXES})


def whole_value(
    by_rank: dict[int, Pieces], mesh: Mesh, shape: tuple[int, ...], *, gradient: bool = False,
) -> tuple[torch.Tensor, float]:
    """The one-device value of a node (of `shape` on one device) from every rank's pieces
    (`by_rank`: the ranks that hold it), and the largest difference between pieces that should
    be equal (0 when none)."""
    pp = min(mesh.coord(r).pp for r in by_rank)
    some = next(p for r, p in by_rank.items() if mesh.coord(r).pp == pp)
    placements = gradient_placements(some.placements) if gradient else some.placements
    if isinstance(placements.dp, FlatShard):
        return _whole_parameter(by_rank, mesh, pp, placements, shape)
    if isinstance(placements.ep, Shard):
        return _whole_experts(by_rank, mesh, pp, placements)
    microbatches = len(some.values)
    spread = 0.0
    batch_pieces = []
    for dp in range(mesh.dp):
        holders = [[by_rank[mesh.rank_of(dp=dp, pp=pp, tp=tp, cp=cp)] for tp in range(mesh.tp)]
                   for cp in range(mesh.cp)]
        if any(len(h.values) != microbatches for row in holders for h in row):
            raise ValueError(f"ranks recorded {[len(h.values) for row in holders for h in row]} "
                             f"microbatches, not {microbatches}")
        for k in range(microbatches):
            sequence_pieces = []  # one per cp rank, each whole over tp
            for row in holders:
                value, s = _combine([h.values[k] for h in row], placements.tp)
                sequence_pieces.append(value)
                spread = max(spread, s)
            value, s = _combine(sequence_pieces, placements.cp)
            batch_pieces.append(value)
            spread = max(spread, s)
    value, s = _combine(batch_pieces, placements.dp)
    return value, max(spread, s)


def _whole_parameter(by_rank: dict[int, Pieces], mesh: Mesh, pp: int, placements: Placements,
                     shape: tuple[int, ...]) -> tuple[torch.Tensor, float]:
    """A ZeRO-3 parameter (FlatShard on dp, inside its tp piece): each tp piece from its dp
    ranks' flat pieces first, then the tp pieces, as `local_slice` cut them in reverse. Every
    microbatch reads the same pieces; they are compared."""
    tp_shape = local_shape(shape, Placements(tp=placements.tp), mesh.sizes)
    spread, tp_pieces = 0.0, []
    for tp in range(mesh.tp):
        holders = [by_rank[mesh.rank_of(dp=dp, pp=pp, tp=tp)] for dp in range(mesh.dp)]
        spread = max([spread, *(_max_difference(h.values[0], v) for h in holders for v in h.values[1:])])
        tp_pieces.append(global_tensor([h.values[0] for h in holders], placements.dp, tp_shape))
    value, s = _combine(tp_pieces, placements.tp)
    return value, max(spread, s)


def _whole_experts(by_rank: dict[int, Pieces], mesh: Mesh, pp: int,
                   placements: Placements) -> tuple[torch.Tensor, float]:
    """An expert weight (Shard on ep, whole over tp): the first expert group's pieces joined;
    every other group's, and every microbatch's, compared with them."""
    groups = [[by_rank[mesh.rank_of(dp=group * mesh.ep + e, pp=pp)].values for e in range(mesh.ep)]
              for group in range(mesh.dp // mesh.ep)]
    first = global_tensor([values[0] for values in groups[0]], placements.ep)
    spread = max((_max_difference(first, global_tensor([values[k] for values in group], placements.ep))
                  for group in groups for k in range(len(group[0]))), default=0.0)
    return first, spread


def _combine(pieces: list[torch.Tensor], placement: Placement) -> tuple[torch.Tensor, float]:
    if isinstance(placement, Shard):
        return global_tensor(pieces, placement), 0.0
    if isinstance(placement, Partial):
        return torch.stack(pieces).sum(0) if len(pieces) > 1 else pieces[0], 0.0
    first = pieces[0]
    spread = max((_max_difference(first, p) for p in pieces[1:]), default=0.0)
    return first, spread


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0
