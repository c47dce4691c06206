"""`fxpar.diff(program_a, program_b)`: what changes between two plans of one model.

    a = fxpar.compile(captured, "dp=4")
    b = fxpar.compile(captured, "dp=2 tp=2")
    print(fxpar.diff(a, b))

    plan diff: 'dp=4' -> 'dp=2 tp=2', 4 -> 4 ranks, 28,544 parameters
    collectives of rank 0 per step         before                after
    + all_reduce   tp  tp all_reduce       -                     7 calls, 18.9 kB
    ~ all_reduce   dp  gradient bucket #   1 call, 114.2 kB      1 call, 61.1 kB
    ...
    bytes rank 0 sends per step (ring)     171.3 kB              ...
    memory peak, pipeline rank 0           790.3 kB              ...
    time.total on h100                     1.234 ms              ...

Collectives are those `program.collectives(rank)` lists for one step, grouped by kind, mesh
axis and purpose (the tag with its numbers written `#`, so "gradient bucket 3" counts with the
other buckets). Memory is each pipeline rank's predicted peak (`fxpar.pictures.rank_memory`), paired by
pipeline index, and the terms of the rank each estimate reports; time is `estimate(hardware)`.
`PlanDiff.rows()` gives the same as table rows (the report's table); `str()` is the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from fxpar.cost.collectives import wire_bytes
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.pictures.payloads import axis_name, format_bytes
from fxpar.pictures.rank_memory import predicted_memory

Cell = tuple[float, float] | float | None  # (calls, bytes), a number, or absent


@dataclass(frozen=True)
class Row:
    """One compared line: its section, what it is, the value before and after."""

    section: str
    item: str
    before: Cell
    after: Cell

    @property
    def mark(self) -> str:
        """"+" added, "-" removed, "~" changed, " " the same."""
        if self.before is None:
            return "+"
        if self.after is None:
            return "-"
        return " " if self.before == self.after else "~"


@dataclass(frozen=True, kw_only=True)
class PlanDiff:
    before: str  # the plans, as text
    after: str
    world_sizes: tuple[int, int]
    parameters: int
    rank: int
    hardware: str
    rows: tuple[Row, ...]

    def table(self) -> list[tuple[str, str, str, str, str]]:
        """(mark, section, item, before, after) strings per row, for a table."""
        return [(r.mark, r.section, r.item, _cell(r.section, r.before), _cell(r.section, r.after))
                for r in self.rows]

    def text(self) -> str:
        lines = [f"plan diff: '{self.before}' -> '{self.after}', {self.world_sizes[0]} -> "
                 f"{self.world_sizes[1]} ranks, {self.parameters:,} parameters"]
        rows = self.table()
        width = max(len(f"{section}: {item}") for _, section, item, _, _ in rows)
        first = max(len(before) for *_, before, _ in rows)
        lines.append(f"  {'':<{width}}  {'before':<{first}}  after")
        for mark, section, item, before, after in rows:
            lines.append(f"{mark} {section + ': ' + item:<{width}}  {before:<{first}}  {after}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def diff(
    before: CompiledProgram,
    after: CompiledProgram,
    *,
    rank: int = 0,
    hardware: str = "h100",
    optimizer: str = "adamw",
) -> PlanDiff:
    """Compare two plans of one model (see module doc). `rank` names the rank whose
    collectives are compared (it must exist under both plans). Raises ValueError for programs
    of different models."""
    names = [set(p.captured.parameters) for p in (before, after)]
    if names[0] != names[1]:
        raise ValueError(
            f"fxpar.diff compares two plans of one model; these programs hold different "
            f"parameters ({len(names[0])} and {len(names[1])} tensors, e.g. "
            f"{sorted(names[0] ^ names[1])[:3]}). Fix: compile both plans from one model or "
            f"one capture (fxpar.capture(model, inputs))"
        )
    for program in (before, after):
        program.mesh.coord(rank)  # raises ValueError naming the mesh's ranks
    rows = _collective_rows(before, after, rank)
    estimates = [p.estimate(hardware, optimizer=optimizer) for p in (before, after)]
    memories = [predicted_memory(p, optimizer=optimizer) for p in (before, after)]
    for i in range(max(p.mesh.pp for p in (before, after))):
        peaks = [m.get(p.mesh.rank_of(pp=i), {}).get("total") if i < p.mesh.pp else None
                 for p, m in zip((before, after), memories)]
        rows.append(Row("memory", f"peak of pipeline rank {i}", *peaks))
    for term in ("params", "grads", "optimizer", "activations"):
        rows.append(Row("memory", f"{term} of the reported rank", *(e.memory[term] for e in estimates)))
    for term in ("total", "compute", "comm_exposed", "bubble"):
        rows.append(Row("time", f"{term} on {hardware}", *(e.time[term] for e in estimates)))
    return PlanDiff(before=str(before.plan), after=str(after.plan),
                    world_sizes=(before.world_size, after.world_size),
                    parameters=before.captured.parameter_count(), rank=rank, hardware=hardware,
                    rows=tuple(rows))


def _collective_rows(before: CompiledProgram, after: CompiledProgram, rank: int) -> list[Row]:
    groups = [collectives_by_purpose(p, rank) for p in (before, after)]
    keys = list(dict.fromkeys([*groups[0], *groups[1]]))
    section = f"rank {rank} per step"
    rows = [Row(section, key, groups[0].get(key), groups[1].get(key)) for key in keys]
    moved = [sum(bytes_ for _, bytes_ in g.values()) for g in groups]
    rows.append(Row("bytes", f"payload of rank {rank}'s collectives per step", *moved))
    sent = [_wire(p, rank) for p in (before, after)]
    rows.append(Row("bytes", f"rank {rank} sends per step (ring algorithms)", *sent))
    return rows


def collectives_by_purpose(program: CompiledProgram, rank: int) -> dict[str, tuple[int, int]]:
    """"kind axis purpose" -> (calls, payload bytes) of `rank`'s step, in first-issue order;
    the purpose is the tag with its numbers written `#` ("gradient bucket #")."""
    found: dict[str, tuple[float, float]] = {}
    for call in program.collectives(rank):
        axis = axis_name(program.mesh, rank, call.group)
        purpose = re.sub(r"[0-9]+", "#", call.tag.removeprefix(f"{axis} "))  # a graph op's tag names its axis
        key = f"{call.kind} {axis} {purpose}"
        calls, moved = found.get(key, (0, 0))
        found[key] = (calls + 1, moved + call.payload_bytes)
    return found


def _wire(program: CompiledProgram, rank: int) -> float:
    return float(sum(wire_bytes(c.kind, c.payload_bytes, len(c.group)) for c in program.collectives(rank)))


def _cell(section: str, value: Cell) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        calls, moved = value
        return f"{calls:.0f} call{'s' if calls != 1 else ''}, {format_bytes(moved)}"
    if section == "time":
        return f"{value * 1e3:.3f} ms"
    return format_bytes(value)


def changed(rows: Sequence[Row]) -> list[Row]:
    """The rows whose value differs between the plans."""
    return [r for r in rows if r.mark != " "]
