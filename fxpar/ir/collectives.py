"""Collectives as data: one call of one rank, and the check that all ranks' calls match.

A rank's step program (`fxpar.ir.step_program`) resolves to the list of `Collective`s it issues
in one step, in issue order. Two uses:

* `check_collectives` proves before any rank runs that on every process group all members
  issue the same sequence (kind, payload, dtype, reduce op): the mismatches that make NCCL
  hang (docs/design.md, decision 7);
* the runtime records what it really issues in the same form (`Runner.comm_log()`), and holds
  each call to the rank's list as it is made (`runtime.step.guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from fxpar.errors import PlanError

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"]
# When in the step a collective runs; the cost model overlaps forward and backward ones with
# compute and counts "step" ones (around the optimizer step) as exposed.
Phase = Literal["forward", "backward", "step"]


# The axes whose groups have communicators of their own even where their ranks are another
# axis' (expert groups carved from dp: `dp=2 ep=2` has one ep group of dp's two ranks). Calls
# on two communicators may interleave (a dp bucket launches between backward's ep calls), so
# their order is held per channel, not per set of ranks (`runtime.step.guard`).
OWN_COMMUNICATORS = ("ep", "edp")


def channel_of(axis: str | None) -> str:
    """The communicator family of a call on mesh axis `axis`: its own for ep and edp, else ""
    (the one communicator of its ranks)."""
    return axis if axis in OWN_COMMUNICATORS else ""


def backend_for(device: torch.device, backend: str | None = None) -> str:
    """`backend` as given, else the torch.distributed backend a rank on `device` binds: NCCL on
    a CUDA device and gloo otherwise (`runtime.binding`; the cost model prices gloo's buffers)."""
    return backend or ("nccl" if device.type == "cuda" else "gloo")


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective call of one rank: its group, payload and purpose."""

    kind: CollectiveKind
    group: tuple[int, ...]  # global ranks of the process group, sorted
    numel: int  # payload elements (all_reduce: its tensor; all_gather: its output; ...)
    dtype: torch.dtype
    op: Literal["sum", "max", "none"] = "sum"
    tag: str = ""  # what it is for, e.g. "gradient bucket 0"; not part of the match
    phase: Phase = "backward"  # not part of the match either
    where: str = field(default="", compare=False)  # the module whose op issues it, if any
    agreement: int = 0  # step-number slots riding at the payload's end (`runtime.step.numbers`)
    channel: str = field(default="", compare=False)  # `channel_of` its axis: whose communicator it uses
    # An all-to-all whose blocks the router sizes (`ops.token_dispatch`): its rows are known
    # only once the router ran, so `numel` is predicted under uniform routing (each rank
    # receives as many rows as it sends) and is no part of the match; the call made is logged
    # with its own. Its splits agree by construction: each rank sends what the exchanged
    # counts say the other receives.
    routed: bool = False

    @property
    def payload_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def signature(self) -> tuple:
        """What all members of the group must agree on."""
        return (self.kind, self.group, None if self.routed else self.numel, self.dtype, self.op)

    def __str__(self) -> str:
        where = f" in module {self.where!r}" if self.where else ""
        routed = ", routed" if self.routed else ""
        return (
            f"{self.kind}({self.numel} x {self.dtype}, op={self.op}{routed}) on ranks "
            f"{list(self.group)} [{self.tag}]{where}"
        )


def check_collectives(
    ranks: int | Iterable[int], collectives_of: Callable[[int], Iterable[Collective]],
    *, whole_groups_only: bool = False,
) -> None:
    """Raise PlanError unless every group's members issue identical collective sequences.

    `ranks`: the world size, or the ranks to compare; with `whole_groups_only`, a group is
    compared only when all its members are among them (the others hold by construction:
    `Program.check`'s representatives)."""
    ranks = range(ranks) if isinstance(ranks, int) else list(ranks)
    chosen = set(ranks)
    per_group: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for rank in ranks:
        for call in collectives_of(rank):
            if call.kind in ("send", "recv"):
                continue  # point to point: matched pair by pair (pipeline_program.check_pipeline)
            if rank not in call.group:
                raise PlanError(f"rank {rank} issues a collective on a group without it: {call}")
            per_group.setdefault(call.group, {}).setdefault(rank, []).append(call)
    for group, by_rank in per_group.items():
        if whole_groups_only and not chosen.issuperset(group):
            continue
        reference_rank = group[0]
        reference = by_rank.get(reference_rank, [])
        for rank in group[1:]:
            calls = by_rank.get(rank, [])
            for i in range(max(len(reference), len(calls))):
                a = reference[i] if i < len(reference) else None
                b = calls[i] if i < len(calls) else None
                if a is None or b is None or a.signature() != b.signature():
                    raise PlanError(
                        f"collective #{i} on process group {list(group)} does not match: rank "
                        f"{reference_rank} issues {a or 'nothing'}, rank {rank} issues "
                        f"{b or 'nothing'}; the job would hang. This is an fxpar bug for a "
                        "plan it accepted: please report it with the plan and model"
                    )
