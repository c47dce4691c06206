"""The step guard: every collective a rank issues is held to its step program as it is made.

The step program (`fxpar.ir.step_program`) lists what the rank issues in one step; the check
proved before launch that those lists match across ranks. At run time the communicator hands
every call to the guard before it reaches torch.distributed, and the guard compares it with
the next call the program lists on the same group (and, for a transfer, in the same
direction: sends to a peer and receives from it are two sequences). Order is held per group,
as NCCL and gloo match calls per communicator; calls on different groups may interleave (a
bucket's all-reduce launches in the middle of backward, between tensor-parallel calls, or an
expert group's calls on the same ranks as dp's, on a communicator of its own).

A call that differs (kind, payload, dtype, reduce op) or is not listed raises
StepProgramError on this rank before anything is sent; `finish` raises if a listed call was
never made. So the step's log equals the program's list, or the step fails and says where.
The expected lists are resolved once per step size (`StepProgram.collectives`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from fxpar.errors import StepProgramError
from fxpar.ir.collectives import Collective
from fxpar.ir.step_program import Part, StepProgram


def _key(group: tuple[int, ...], kind: str, channel: str = "") -> tuple:
    """Calls are held in order per group (per communicator: an expert group's channel is its
    own, `ir.collectives.OWN_COMMUNICATORS`), and per direction for a pair's transfers."""
    return (channel, group, kind if kind in ("send", "recv") else "collective")


class StepGuard:
    """Holds the calls of one part of a rank's step program ("step": `runner.step`,
    "optimizer": the optimizer's step) to the calls made (module doc)."""

    def __init__(self, program: StepProgram, part: Part = "step"):
        self.program, self.part = program, part
        self._resolved: dict[tuple, dict[tuple, list[Collective]]] = {}  # per step size
        self._expected: dict[tuple, list[Collective]] = {}
        self._next: dict[tuple, int] = {}

    def start(self, sizes: Mapping) -> None:
        """Expect one step's calls at `sizes` (export's symbols -> one global microbatch),
        resolved once per size."""
        size_key = tuple(sizes.items())  # symbols hash fast; another order only resolves again
        if size_key not in self._resolved:
            by_group: dict[tuple, list[Collective]] = {}
            for call in self.program.collectives(sizes, self.part):
                by_group.setdefault(_key(call.group, call.kind, call.channel), []).append(call)
            self._resolved[size_key] = by_group
        self._expected = self._resolved[size_key]
        self._next = dict.fromkeys(self._expected, 0)

    def agreement_slots(self, group: tuple[int, ...]) -> int:
        """How many step-number slots the program's next collective on `group` carries at its
        end (`lowering.ride_agreements`; 0 for most calls)."""
        key = _key(group, "all_reduce")
        expected, position = self._expected.get(key, ()), self._next.get(key, 0)
        return expected[position].agreement if position < len(expected) else 0

    def admit(self, kind: str, group: tuple[int, ...], numel: int, dtype, op: str, tag: str = "",
              channel: str = "") -> Collective:
        """Let a call through if it is the next one the program lists on its group (its
        `Collective.signature()` fields; `tag` names it in the error; `channel` the
        communicator, where ranks have several); returns the listed call, which the
        communicator logs: equal to the call made in all that the ranks match on (a routed
        all-to-all's with the rows it moves, which the router decided)."""
        key = _key(group, kind, channel)
        expected = self._expected.get(key, ())
        position = self._next.get(key, 0)
        wanted = expected[position] if position < len(expected) else None
        if wanted is None or wanted.signature() != (kind, group, None if wanted.routed else numel, dtype, op):
            made = Collective(kind=kind, group=group, numel=numel, dtype=dtype, op=op, tag=tag)
            where = f"call #{position} of its {len(expected)} on that group"
            raise StepProgramError(
                f"rank {self.program.rank} was about to issue {made}, but its step program's "
                f"{where} is {wanted or 'nothing (no more calls there)'}. Its peers follow "
                "their programs, so the call would pair with another or hang; nothing was sent. "
                "Fix: an edited step program (Program.replace_step_program) must match the "
                "model; otherwise this is an fxpar bug: please report it with the plan"
            )
        self._next[key] = position + 1
        return replace(wanted, numel=numel) if wanted.routed else wanted

    def finish(self) -> None:
        """At the end of a step: raise unless every listed call was made."""
        for key, expected in self._expected.items():
            position = self._next[key]
            if position < len(expected):
                raise StepProgramError(
                    f"rank {self.program.rank} finished its step without issuing "
                    f"{expected[position]} (call #{position} of {len(expected)} on that group), "
                    "which its step program lists: its peers wait for it. This is an fxpar bug "
                    "unless the step program was edited: please report it with the plan"
                )
