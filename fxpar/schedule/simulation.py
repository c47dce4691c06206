"""The pipeline simulator: a schedule on a clock, its bubble, its memory, its deadlocks.

`simulate(schedule, F, B, weight_cost=W, comm_cost=c)` runs each rank's actions in order, each
as early as its dependencies allow, and returns a `Simulation`: every action's start and end,
the step's makespan, each rank's busy time, the bubble fraction and the activations each rank
holds at its peak. `fxpar.schedule.schedules` builds the schedules it runs (and prints their grids with
it); the cost model reads its bubble term from it, and the benchmarks compare it with measured
timelines.

An order that waits on itself raises `DeadlockError` naming each blocked action, what it
waits for, and the grid up to the point where it stopped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from fractions import Fraction
from itertools import accumulate
from numbers import Rational

from fxpar.schedule.actions import Action


class ScheduleLike(Protocol):
    """What the simulator reads of a `fxpar.schedule.schedules.Schedule` (which prints itself through
    the simulator, so this module cannot import it)."""

    name: str
    p: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int: ...

    @property
    def splits_backward(self) -> bool: ...

    def rank_of(self, stage: int) -> int: ...


class DeadlockError(ValueError):
    """No rank can start its next action: the per-rank orders wait on each other."""


Timeline = tuple[tuple[tuple[Action, float, float], ...], ...]


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """The timeline of one step. `timeline[r]` holds (action, start, end) in rank r's order.

    `peak_in_flight[r]` is the most (stage, microbatch) pairs whose forward has run on rank r
    and whose backward has not (whose W has not, in a split schedule): activations held, in
    units of one stage's activations for one microbatch. With v chunks per rank a stage holds
    1/v of the rank's layers, so the memory is about `peak_in_flight[r] / v` microbatches of
    the whole rank's activations.
    """

    schedule: ScheduleLike
    timeline: Timeline
    total: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]

    def grid(self) -> str:
        """One column per distinct start time; "~" while an action continues, "." idle."""
        return _grid(self.timeline)


def _per_stage(cost: float | Sequence[float], stages: int, what: str) -> list[float]:
    if isinstance(cost, Sequence):
        if len(cost) != stages:
            raise ValueError(f"{what} has {len(cost)} entries for {stages} stages; one per stage")
        return list(cost)
    return [cost] * stages


def simulate(
    schedule: ScheduleLike,
    forward_cost: float | Sequence[float],
    backward_cost: float | Sequence[float],
    *,
    weight_cost: float | Sequence[float] = 0,
    comm_cost: float = 0.0,
    action_cost: Mapping[Action, float] | None = None,
) -> Simulation:
    """Run the schedule on a clock. Costs are one number or one per stage (length p * v).

    F(s, mb) waits for F(s-1, mb); B(s, mb) waits for F(s, mb) and B(s+1, mb) (the last stage
    only for its forward); W(s, mb) waits for B(s, mb), on the same rank. `comm_cost` is added
    when the two stages sit on different ranks. Each rank runs its list in order, one action at
    a time, as early as these allow. Exact when the costs are ints or Fractions.

    In a split schedule ([Note: B and W]) `backward_cost` is the input-gradient part of each
    stage's backward and `weight_cost` the weight-gradient part. Without W actions the whole
    backward is `backward_cost`, and a nonzero `weight_cost` is refused.

    `action_cost`, when given, is every action's own cost and overrides the per-stage ones: a
    measured step replayed through these rules (`benchmarks/bubble.py`).
    """
    s = schedule
    cost = _costs_by_kind(s, forward_cost, backward_cost, weight_cost)
    timeline, clock = _run(s, cost, comm_cost, action_cost)
    total = max(clock, default=0)
    busy = tuple(sum(e - b for _, b, e in row) for row in timeline)
    idle = sum(total - b for b in busy)
    return Simulation(
        schedule=s,
        timeline=tuple(map(tuple, timeline)),
        total=total,
        busy=busy,
        bubble_fraction=_ratio(idle, s.p * total),
        peak_in_flight=_peak_in_flight(s),
    )


def _costs_by_kind(
    s: ScheduleLike,
    forward_cost: float | Sequence[float],
    backward_cost: float | Sequence[float],
    weight_cost: float | Sequence[float],
) -> dict[str, list[float]]:
    """Action kind -> its cost on each stage; a weight cost is refused where no W runs."""
    forward = _per_stage(forward_cost, s.stages, "forward_cost")
    backward = _per_stage(backward_cost, s.stages, "backward_cost")
    weight = _per_stage(weight_cost, s.stages, "weight_cost")
    if any(weight) and not s.splits_backward:
        raise ValueError(
            f"{s.name}: weight_cost={weight_cost} but the schedule runs no W actions: its B is "
            f"the whole backward. Fix: add the weight gradient's time to backward_cost"
        )
    return {"F": forward, "B": backward, "W": weight}


def _run(
    s: ScheduleLike,
    cost: dict[str, list[float]],
    comm_cost: float,
    action_cost: Mapping[Action, float] | None,
) -> tuple[list[list[tuple[Action, float, float]]], list[float]]:
    """Each rank's (action, start, end) in its order, and the time each rank finishes: sweep
    the ranks, starting each one's next action once what it `_needs` has ended, until none
    can start; raise `DeadlockError` if some rank has actions left."""
    end: dict[Action, float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(s.p)]
    clock: list[float] = [0] * s.p
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(s.actions):
            while len(timeline[rank]) < len(row):
                a = row[len(timeline[rank])]
                deps = _needs(a, s.stages)
                if any(d not in end for d in deps):
                    break
                start = clock[rank]
                for d in deps:
                    hop = comm_cost if comm_cost and s.rank_of(d.stage) != rank else 0
                    start = max(start, end[d] + hop)
                duration = cost[a.kind][a.stage] if action_cost is None else action_cost[a]
                clock[rank] = end[a] = start + duration
                timeline[rank].append((a, start, end[a]))
                progress = True
    if any(len(done) < len(row) for done, row in zip(timeline, s.actions)):
        raise DeadlockError(_deadlock_message(s, timeline, end))
    return timeline, clock


def _needs(a: Action, stages: int) -> list[Action]:
    """The actions `a` waits for (`simulate`'s rules), of a schedule with `stages` stages."""
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action(a.stage, "B", a.microbatch)]
    deps = [Action(a.stage, "F", a.microbatch)]
    return deps + ([Action(a.stage + 1, "B", a.microbatch)] if a.stage < stages - 1 else [])


def _peak_in_flight(s: ScheduleLike) -> tuple[int, ...]:
    """Per rank, the most (stage, microbatch) pairs whose activations it holds at once
    (`Simulation.peak_in_flight`): each F adds one, the action that frees them takes one away."""
    releases = "W" if s.splits_backward else "B"  # the action after which activations are freed
    held = {"F": 1, releases: -1}
    steps = [accumulate((held.get(a.kind, 0) for a in row), initial=0) for row in s.actions]
    return tuple(map(max, steps))


def _ratio(part: float, whole: float) -> float:
    """`part / whole`, a Fraction when both are ints or Fractions, so tests can use `==`."""
    if not whole:
        return 0
    exact = isinstance(part, Rational) and isinstance(whole, Rational)
    return Fraction(part) / whole if exact else part / whole


def _deadlock_message(s: ScheduleLike, timeline: list, end: dict[Action, float]) -> str:
    lines = [f"{s.name}: deadlock, no rank can start its next action:"]
    blocked: dict[int, Action] = {}
    for rank, row in enumerate(s.actions):
        if len(timeline[rank]) == len(row):
            continue
        a = blocked[rank] = row[len(timeline[rank])]
        waits = []
        for d in (d for d in _needs(a, s.stages) if d not in end):
            at = [f"rank {r}, step {its.index(d)}" for r, its in enumerate(s.actions) if d in its]
            waits.append(f"{d} ({at[0] if at else 'which no rank runs'})")
        lines.append(f"  rank {rank} step {len(timeline[rank])}: {a} waits for {', '.join(waits)}")
    lines.append("grid so far, '!' marks each blocked action:")
    lines.append(_grid(timeline, blocked=blocked))
    lines.append("fix: reorder so each rank runs an action only after what it waits for can run")
    return "\n".join(lines)


def _grid(timeline: Timeline | list, *, blocked: dict[int, Action] | None = None) -> str:
    """Rows per rank, columns at each distinct start time; blocked actions in a last column."""
    times = sorted({start for row in timeline for _, start, _ in row})
    header = [f"t{i}" for i in range(len(times))] + (["blocked"] if blocked else [])
    rows = []
    for rank, row in enumerate(timeline):
        starts = {start: a for a, start, _ in row}
        cells = [
            str(starts[t]) if t in starts else "~" if any(b < t < e for _, b, e in row) else "."
            for t in times
        ]
        if blocked:
            cells.append(f"{blocked[rank]}!" if rank in blocked else "")
        rows.append([f"rank {rank}"] + cells)
    table = [[""] + header] + rows
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join(
        " ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table
    )
