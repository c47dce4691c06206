"""Pipeline schedules as data: which rank runs which forward or backward, in what order.

Map of this module:

- `Action`              one step, written "1F0": stage 1 runs the forward of microbatch 0
- `Schedule`            per pipeline rank, the ordered actions of one training step
- `gpipe`, `one_f_one_b`, `interleaved_one_f_one_b`, `zero_bubble_h1`,
  `schedule(name, p, m, v)`   constructors
- `check(schedule)`     every (stage, microbatch) has one F and one B (and one W in a split
                        schedule), in that order, on its rank
- `fxpar.schedule.simulation.simulate(...)`   a timeline from per-stage costs: makespan, idle time,
                        activations held (its own module)
- `Schedule.grid()`, `Schedule.to_text()`, `Schedule.from_text()`   printed forms

Stages and ranks. With p pipeline ranks and v virtual stages (chunks) per rank there are
S = p * v stages, and stage s lives on rank `s % p` (Megatron's interleaved placement: rank r
holds stages r, r + p, r + 2p, ...). With v == 1, stage s is rank s.

`str(schedule)` is its grid: one row per rank, one column per time slot of a simulation with unit
costs, "." where the rank idles. 1F1B with p=2, m=3 (`print(schedule("1f1b", 2, 3))`)::

           t0  t1  t2  t3  t4  t5  t6  t7
    rank 0 0F0 0F1 .   0B0 0F2 0B1 .   0B2
    rank 1 .   1F0 1B0 1F1 1B1 1F2 1B2 .

The idle cells are the bubble. `simulate` measures it with real costs; with the same costs on
every stage (a chunk costing 1/v of a rank) and no communication, GPipe and 1F1B idle a fraction
(p-1)/(m+p-1) of the step (GPipe, Huang et al. 2019, Sec. 2.3) and interleaved 1F1B
(p-1)/(v m + p - 1) (Narayanan et al. 2021, Sec. 2.2.2); docs/design.md, "Pipeline bubble". The
cost model's bubble term is meant to read `simulate(...).bubble_fraction`, so that a new schedule
needs no new formula.

Split backward [Note: B and W]. A schedule may split each backward in two (Qi et al. 2024,
"Zero Bubble Pipeline Parallelism", Sec. 2): "B" computes the gradient of the stage's inputs,
which the previous stage waits for, and "W" (written "0W3") the gradient of its weights, which
nobody waits for and can fill the rank's idle slots. In such a schedule (`splits_backward`)
every (stage, microbatch) has an F, a B and a W, the W after the B on the same rank. A schedule
without W runs the whole backward as "B". ZB-H1 (`zero_bubble_h1`, Sec. 3.1) is 1F1B with the
Ws deferred. Each rank idles (p-1)(F+B-W) when W <= F and W <= B (the paper's figure; in
general (p-1) max(F+B-W, F, B)), against 1F1B's (p-1)(F+B+W): with F = B = W = 1 the bubble
fraction is (p-1)/(3m+p-1), a third of 1F1B's idle time. ZB-H1 holds activations of p
microbatches on every rank (from F until W), 1F1B's peak on rank 0. Counting until W is an
upper bound: a W needs only the inputs of the stage's weight matmuls and their output
gradients, not every saved tensor.

The simulator (`fxpar.schedule.simulation`) never hangs: an order that waits on itself raises
`DeadlockError` naming each blocked action, what it waits for, and the grid so far.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

from fxpar.schedule.actions import Action
from fxpar.schedule.simulation import DeadlockError, simulate


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """`actions[r]` is what pipeline rank r executes, in order, in one training step."""

    name: str
    p: int
    v: int
    m: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding `stage`: `stage % p`."""
        return stage % self.p

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for row in self.actions for a in row)

    def grid(self) -> str:
        """The grid of a unit-cost simulation (F = B = W = 1, no comm): one column per time step."""
        return simulate(self, 1, 1, weight_cost=1 if self.splits_backward else 0).grid()

    def __str__(self) -> str:
        try:
            return self.grid()
        except DeadlockError as error:  # print what ran and where it stuck, never raise
            return str(error)

    def to_text(self) -> str:
        """A header line and one line per rank: `rank 0: 0F0 0F1 0B0 ...`; see `from_text`."""
        rows = (f"rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(self.actions))
        return "\n".join([f"schedule {self.name} p={self.p} v={self.v} m={self.m}", *rows])

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Read `to_text`'s form. Without the header p, v and m are inferred from the actions."""
        header: dict[str, str] = {}
        rows: dict[int, tuple[Action, ...]] = {}
        for line in filter(None, (raw.strip() for raw in text.splitlines())):
            if line.startswith("schedule"):
                words = line.split()
                header = dict(word.split("=", 1) for word in words[2:])
                header["name"] = words[1]
                continue
            found = re.fullmatch(r"rank\s+(\d+)\s*:(.*)", line)
            if found is None:
                raise ValueError(f"cannot read line {line!r}: expected 'rank <r>: 0F0 0B0 ...'")
            rows[int(found[1])] = tuple(Action.parse(word) for word in found[2].split())
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"ranks {sorted(rows)} are not 0..{len(rows) - 1}; give each a line")
        every = [a for row in rows.values() for a in row]
        p = int(header.get("p", len(rows)))
        v = int(header.get("v", max((a.stage for a in every), default=0) // p + 1))
        m = int(header.get("m", max((a.microbatch for a in every), default=-1) + 1))
        actions = tuple(rows.get(r, ()) for r in range(p))
        return cls(name=header.get("name", "custom"), p=p, v=v, m=m, actions=actions)


def _require_positive(**numbers: int) -> None:
    for key, value in numbers.items():
        if value < 1:
            raise ValueError(f"{key}={value}: a pipeline schedule needs {key} >= 1")


def _warm_up_then_alternate(
    warmup: int, steps: int, forward: Callable[[int], Action], backward: Callable[[int], Action]
) -> tuple[Action, ...]:
    """One rank's row: `warmup` forwards, then forward k + warmup with backward k, then drain.

    GPipe and both 1F1Bs are this shape; they differ in the warm-up and in which stage and
    microbatch forward step k and backward step k run. ZB-H1 adds its Ws to 1F1B's rows.
    """
    row = [forward(k) for k in range(warmup)]
    for k in range(steps - warmup):
        row += [forward(warmup + k), backward(k)]
    return tuple(row + [backward(k) for k in range(steps - warmup, steps)])


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every rank runs F0..F(m-1), then B0..B(m-1).

    The order of torch.distributed.pipelining's `ScheduleGPipe`: 1F1B with all m forwards in
    the warm-up. All m microbatches' activations are held at once: peak in flight m.
    """
    _require_positive(p=p, m=m)
    rows = (
        _warm_up_then_alternate(m, m, partial(Action, r, "F"), partial(Action, r, "B"))
        for r in range(p)
    )
    return Schedule(name="gpipe", p=p, v=1, m=m, actions=tuple(rows))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B, PipeDream-flush (Narayanan et al. 2021, Sec. 2.2.1).

    Rank r runs p - r - 1 warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards. At most p - r microbatches are in flight on rank r.
    """
    _require_positive(p=p, m=m)
    if m < p:
        raise ValueError(
            f"1f1b needs at least as many microbatches as pipeline ranks: m={m} < p={p}; "
            f"use m >= {p} or the 'gpipe' schedule"
        )
    rows = (
        _warm_up_then_alternate(p - r - 1, m, partial(Action, r, "F"), partial(Action, r, "B"))
        for r in range(p)
    )
    return Schedule(name="1f1b", p=p, v=1, m=m, actions=tuple(rows))


def interleaved_one_f_one_b(p: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2), in Megatron-LM's order.

    Rank r runs m * v forward steps. Forward step k uses chunk `(k // p) % v` and microbatch
    `(k // (p v)) p + k % p`: microbatches go through a chunk in groups of p. Backward step k
    uses the same microbatch and chunk `v - 1 - (k // p) % v`. Stage = chunk * p + r. Rank r
    warms up with `(p - r - 1) * 2 + (v - 1) * p` forwards (Megatron-LM's
    `forward_backward_pipelining_with_interleaving`), then alternates, then drains.
    """
    _require_positive(p=p, v=v, m=m)
    if v < 2:
        raise ValueError(f"interleaved needs v >= 2 chunks per rank, got v={v}; use '1f1b' for v=1")
    if m % p:
        raise ValueError(
            f"interleaved needs the microbatches to be a multiple of the pipeline ranks: "
            f"m={m}, p={p}, m % p = {m % p}; use m={m + p - m % p} or m={m - m % p or p}"
        )

    def step(r: int, kind: Literal["F", "B"], k: int) -> Action:
        chunk = (k // p) % v if kind == "F" else v - 1 - (k // p) % v
        return Action(chunk * p + r, kind, (k // (p * v)) * p + k % p)

    rows = (
        _warm_up_then_alternate(
            min((p - r - 1) * 2 + (v - 1) * p, m * v), m * v,
            partial(step, r, "F"), partial(step, r, "B"),
        )
        for r in range(p)
    )
    return Schedule(name="interleaved", p=p, v=v, m=m, actions=tuple(rows))


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, Sec. 3.1): 1F1B with each backward split into B and W.

    Rank r runs 1F1B's row with B the input gradient, and after its k-th B, from k = r on, the
    oldest weight gradient W not yet run; the Ws left at the end drain. Rank r thus delays its
    first W by r steps: that keeps p microbatches in flight (F until W) on every rank, 1F1B's
    rank-0 peak, while the deferred Ws fill the slots where 1F1B idles in the drain. With
    F = B = W = 1 the bubble is (p-1)/(3m+p-1). p=2, m=3 (`print(zero_bubble_h1(2, 3))`)::

               t0  t1  t2  t3  t4  t5  t6  t7  t8  t9
        rank 0 0F0 0F1 .   0B0 0W0 0F2 0B1 0W1 0B2 0W2
        rank 1 .   1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2
    """
    _require_positive(p=p, m=m)
    if m < p:
        raise ValueError(
            f"zb-h1 needs at least as many microbatches as pipeline ranks: m={m} < p={p}; "
            f"use m >= {p} or the 'gpipe' schedule"
        )
    rows = []
    for r in range(p):
        warmup = p - r - 1
        weights = iter(range(m))  # the next W to run: Ws go in microbatch order
        row = [Action(r, "F", k) for k in range(warmup)]
        for k in range(m):
            row += [Action(r, "F", warmup + k)] if warmup + k < m else []
            row += [Action(r, "B", k)] + ([Action(r, "W", next(weights))] if k >= r else [])
        rows.append(tuple(row + [Action(r, "W", k) for k in weights]))
    return Schedule(name="zb-h1", p=p, v=1, m=m, actions=tuple(rows))


SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")  # what `schedule` builds, and `Plan.schedule` accepts
_ONE_STAGE_PER_RANK: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1,
}


def schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a schedule by name: "gpipe", "1f1b", "zb-h1" (v == 1), "interleaved" (v >= 2)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid names are {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_one_f_one_b(p, v, m)
    if v != 1:
        raise ValueError(f"{name} runs one stage per rank, got v={v}; use v=1 or 'interleaved'")
    return _ONE_STAGE_PER_RANK[name](p, m)


def check(schedule: Schedule) -> None:
    """Raise ValueError unless every (stage, microbatch) has exactly one F and one B, the F
    before the B, both on the stage's rank `stage % p`; in a split schedule also exactly one W,
    after the B ([Note: B and W]). Says nothing about deadlock: `simulate`."""
    s = schedule
    kinds = ("F", "B", "W") if s.splits_backward else ("F", "B")
    if len(s.actions) != s.p:
        raise ValueError(f"{s.name}: {len(s.actions)} rows for p={s.p} ranks; give one per rank")
    seen: dict[Action, int] = {}
    for rank, row in enumerate(s.actions):
        for position, a in enumerate(row):
            where = f"{s.name}: rank {rank} step {position} ({a})"
            if not (0 <= a.stage < s.stages and 0 <= a.microbatch < s.m):
                raise ValueError(
                    f"{where}: need stage in 0..{s.stages - 1}, microbatch in 0..{s.m - 1}"
                )
            if s.rank_of(a.stage) != rank:
                raise ValueError(f"{where}: stage {a.stage} lives on rank {a.stage % s.p}")
            if a in seen:
                raise ValueError(f"{where}: already runs at step {seen[a]}; run it once")
            if a.kind == "B" and Action(a.stage, "F", a.microbatch) not in seen:
                raise ValueError(f"{where}: backward before its forward; swap them")
            if a.kind == "W" and Action(a.stage, "B", a.microbatch) not in seen:
                raise ValueError(f"{where}: weight gradient before its backward (B); swap them")
            seen[a] = position
    missing = [
        str(Action(stage, kind, mb))
        for stage in range(s.stages) for mb in range(s.m) for kind in kinds
        if Action(stage, kind, mb) not in seen
    ]
    if missing:
        raise ValueError(f"{s.name}: missing actions {' '.join(missing[:8])}; add them")
