"""The step program: everything one rank does in one training step, in order, as data.

Lowering (`fxpar.compiler.lowering`) turns the compiled job into one `StepProgram` per rank. Each is a
list of actions, and each action lists the communication calls it makes:

    Communicate  VALID_TARGETS         all_reduce(1+dp x int64) on dp   the step's count and
                                                                     step numbers (where
                                                                     no bucket carries them)
    Communicate  STEP_AGREEMENT        all_reduce(pp x (2+d) x int64)   step numbers and the
                                       on pp (and tp)                batch's identity
    Compute      F  stage 0  mb 0      tp f / g all-reduces             its graph's ops
    Exchange     send stage 1 activations, receive stage 0 gradients     pipeline transfers
    Compute      B  stage 0  mb 0      tp backward all-reduces
    Communicate  GRADIENT_BUCKET 0     all_reduce(n x f32) on dp       DDP's bucket (the first
                                                                     with dp's count and
                                                                     step numbers riding)
    Communicate  PIPELINE_LOSS         all_reduce(1 x f32) on pp
    and, around the optimizer step (`optimizer`, ZeRO-1/2):
    Communicate  UPDATED_PARAMETERS 0  all_gather(n x f32) on dp       a bucket's new values

A call (`Call`) names its mesh axis, not a group, and its payload is a formula in export's
size symbols at one microbatch of the global batch, so one list of actions serves every rank
of a pipeline rank's row (ranks differ only in their coordinates) and every batch size.
`StepProgram.collectives(sizes)` resolves the calls for one rank at given sizes into
`fxpar.ir.collectives.Collective`s, the record the check compares and the runtime logs.

Who reads it, and nothing else:

    Program.collectives(r)       the calls of rank r at the example's sizes
    Program.state_program(r)     the calls of gathering the full state (`full_state_dict`)
    Program.check()              all ranks' lists, matched group by group
    cost.estimate                the communication terms (through Program.collectives)
    the runtime                  executes the actions in order (`runtime.step.guard` holds
                                 every collective the rank issues to its list, so the log
                                 equals the list or the step fails before the call is made)

Editing one rank's program (`Program.replace_step_program`) is seen by all of them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import sympy
import torch

from fxpar.ir.collectives import Collective, CollectiveKind, Phase, channel_of
from fxpar.ir.mesh import Axis, Mesh


class Purpose(enum.Enum):
    """What a `Communicate` action is for: the runtime's handler for it."""

    VALID_TARGETS = "the step's count of valid targets, with the ranks' step numbers"
    STEP_AGREEMENT = "the ranks' step numbers, compared before the step's first data moves"
    GRADIENT_BUCKET = "a gradient bucket's reduction"
    UPDATED_PARAMETERS = "a bucket's updated parameters gathered (ZeRO-1/2)"
    PARTIAL_GRADIENTS = "replicated parameters' partial tp or cp gradients summed"
    TIED_GRADIENT = "a parameter's gradient summed over the stages that share it"
    PIPELINE_LOSS = "the loss summed over the pipeline"
    LOSS = "the loss summed over data-parallel (or context-parallel) ranks"
    # Gathering the full state (`Program.state_program`), outside a step:
    GRADIENT_SHARDS = "a bucket's reduced gradient shards gathered whole (ZeRO)"
    DP_SHARDS = "a ZeRO-3 parameter's (or its gradient's) data-parallel shards gathered whole"
    TP_SHARDS = "a tensor's tensor-parallel shards gathered whole"
    EP_SHARDS = "an expert weight's (or its gradient's) expert-parallel shards gathered whole"
    STAGE_STATE = "a pipeline rank's whole tensors broadcast to its pipeline group"


@dataclass(frozen=True)
class Call:
    """One collective or transfer, before it is given to a rank.

    The group is `axis` on the rank's mesh, or, for a transfer, the rank and the one holding
    `peer_stage`, or, for a tied parameter's gradient, the owners of `tied`. `numel` is a
    formula in export's size symbols (an int when fixed); a transfer's `shape` is the tensor as
    this rank holds it, whose product `numel` is: the executor allocates receive buffers from
    it, so what runs is what the check and the cost model read."""

    kind: CollectiveKind
    numel: sympy.Expr | int
    dtype: torch.dtype
    axis: str | None = None
    op: Literal["sum", "max", "none"] = "sum"
    tag: str = ""
    phase: Phase = "backward"
    peer_stage: int | None = None
    tied: str | None = None
    where: str = ""  # the module whose op issues it (a graph call), for messages
    agreement: int = 0  # the step agreement's slots riding at its end (`lowering.ride_agreements`)
    count: int = 0  # the step's count of valid targets' slots riding before them (dp's first bucket)
    batch: int = 0  # a step agreement's slots per member after the step numbers: the batch's
    # fingerprint and sizes, which every member must share (`runtime.step.batch_identity`)
    shape: tuple = ()  # a transfer's local shape, formulas in export's size symbols
    routed: bool = False  # an all-to-all the router sizes: `numel` under uniform routing (`Collective.routed`)


@dataclass(frozen=True)
class Compute:
    """Run one schedule action: forward, backward or weight gradients of `stage` on
    `microbatch`. `calls` are what its graph's distributed ops issue, in order."""

    kind: Literal["F", "B", "W"]
    stage: int
    microbatch: int
    calls: tuple[Call, ...] = ()

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Receive:
    """The tensors the compute action at `action` (its position in the program's row of
    compute actions) receives: one call per tensor."""

    action: int
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class Exchange:
    """Start as one batch the sends of the compute action that just ran and the receives of
    later ones (`pipeline_program.issue_order` says which: on gloo one action ahead)."""

    sends: tuple[Call, ...]
    receives: tuple[Receive, ...]

    @property
    def calls(self) -> tuple[Call, ...]:
        return (*self.sends, *(c for r in self.receives for c in r.calls))


@dataclass(frozen=True)
class Communicate:
    """A collective the runtime issues itself (`Purpose`): `stage` and `index` say whose
    (a bucket's stage and index, the pipeline rank a STAGE_STATE broadcast comes from), `name`
    a tied parameter or a state tensor, `entries` the (name, whole shape) of each tensor of a
    STAGE_STATE broadcast, in the order they are laid out in it."""

    purpose: Purpose
    calls: tuple[Call, ...]
    stage: int = 0
    index: int = 0
    name: str = ""
    entries: tuple[tuple[str, tuple[int, ...]], ...] = ()


StepAction = Compute | Exchange | Communicate
Part = Literal["step", "optimizer", "all"]


@dataclass(frozen=True, eq=False)
class StepProgram:
    """One rank's step: its actions (shared by every rank of its pipeline row) and how its
    calls resolve to groups. `stage_ranks[s]` is the pipeline rank holding stage s;
    `tied_groups` maps a tied parameter to this rank's group of its owners."""

    rank: int
    mesh: Mesh
    actions: tuple[StepAction, ...]
    stage_ranks: tuple[int, ...] = ()
    tied_groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    optimizer: tuple[StepAction, ...] = ()  # around the optimizer step (ZeRO's parameter gathers)

    def calls(self, part: Part = "all") -> list[Call]:
        """Every call of the step, in issue order: of `runner.step` ("step"), of the optimizer's
        step ("optimizer"), or both, in that order ("all")."""
        actions = {"step": self.actions, "optimizer": self.optimizer, "all": (*self.actions, *self.optimizer)}[part]
        return [call for action in actions for call in action.calls]

    def count_slots(self) -> int:
        """Slots of the step's count of valid targets riding in its first gradient bucket
        (`lowering.ride_agreements`), 0 where the count has a call of its own or none: the
        rank's graphs are then given a count of 1 (their loss a sum) and the buckets divide
        the summed gradients and loss by the global count (`runtime.state.gradient_buckets`)."""
        return next((c.count for c in self.calls("step") if c.count), 0)

    def computes(self) -> list[Compute]:
        """The compute actions, in order: the schedule row this rank runs."""
        return [a for a in self.actions if isinstance(a, Compute)]

    def group(self, call: Call) -> tuple[int, ...]:
        """The global ranks `call` runs on, sorted."""
        if call.peer_stage is not None:
            coord = self.mesh.coord(self.rank)
            peer = self.mesh.rank_of(dp=coord.dp, pp=self.stage_ranks[call.peer_stage], tp=coord.tp, cp=coord.cp)
            return tuple(sorted((self.rank, peer)))
        if call.tied is not None:
            return self.tied_groups[call.tied]
        return self.mesh.group(self.rank, Axis(call.axis))

    def collectives(self, sizes: Mapping[sympy.Symbol, int], part: Part = "all") -> tuple[Collective, ...]:
        """The calls of `part` (`calls`) resolved for this rank at `sizes` (export's symbols ->
        one microbatch of the global batch), in issue order."""
        groups: dict[tuple, tuple[int, ...]] = {}
        numels: dict[object, int] = {}
        result = []
        for call in self.calls(part):
            where = (call.axis, call.peer_stage, call.tied)
            if where not in groups:
                groups[where] = self.group(call)
            if call.numel not in numels:
                numels[call.numel] = evaluate(call.numel, sizes)
            result.append(Collective(
                kind=call.kind, group=groups[where], numel=numels[call.numel], dtype=call.dtype,
                op=call.op, tag=call.tag, phase=call.phase, where=call.where, agreement=call.agreement,
                channel=channel_of(call.axis), routed=call.routed,
            ))
        return tuple(result)

    def replace_actions(self, actions) -> StepProgram:
        """This program with other actions (an edited step, for a test or a tool)."""
        return replace(self, actions=tuple(actions))


def evaluate(numel: sympy.Expr | int, sizes: Mapping[sympy.Symbol, int]) -> int:
    """A payload formula's value at `sizes`."""
    if isinstance(numel, int):
        return numel
    value = sympy.sympify(numel).xreplace(sizes)
    if not value.is_Integer:
        raise ValueError(f"payload {numel} is not a whole number of elements at {dict(sizes)}: {value}")
    return int(value)
