"""`fxpar explain`: what a plan does, as text: stages, buckets, collectives per step, estimate.

    print(explain(program, rank=0, hardware="h100"))

Everything is read off one rank (`rank`, default 0) and the estimate, never off all ranks:
`program.check()` matches every rank's collectives and is its own command (`fxpar check`), so
explaining the GPT-3 175B shape at 1024 ranks takes seconds, not minutes.
"""

from __future__ import annotations

from fxpar.ir.compiled_program import CompiledProgram
from fxpar.pictures.payloads import format_bytes
from fxpar.tools.diff import collectives_by_purpose


def explain(program: CompiledProgram, *, rank: int = 0, hardware: str = "h100") -> str:
    """The plan, its stages and schedule, `rank`'s buckets and collectives, and the estimate."""
    mesh, captured = program.mesh, program.captured
    inputs = ", ".join(f"{n} {tuple(s)}" for n, s in zip(captured.input_names, captured.example_shapes))
    lines = [
        f"plan '{program.plan}' on {mesh}: {program.world_size} ranks",
        f"model: {captured.parameter_count():,} parameters; example batch {inputs}",
        "",
        "stages:",
    ]
    if program.stages is None:
        lines.append("  no pipeline (pp=1): every rank runs the whole graph")
    else:
        lines += [f"  {line}" for line in program.describe_stages().splitlines()]
        lines += ["", f"schedule ({program.plan.schedule}, {program.plan.microbatches} microbatches):"]
        lines += [f"  {line}" for line in str(program.schedule).splitlines()]
    lines += ["", f"gradient buckets of rank {rank} ({mesh.position(rank)}), in launch order:"]
    lines += _buckets(program, rank)
    if program.plan.zero in (2, 3) and program.plan.dp > 1:  # the one decision ZeRO leaves the cost model
        lines += ["", f"ZeRO-{program.plan.zero} {program.zero_reduce}"]
    calls = program.collectives(rank)
    lines += ["", f"collectives of rank {rank} per step: {len(calls)} calls, "
                  f"{format_bytes(sum(c.payload_bytes for c in calls))} of payload"]
    grouped = collectives_by_purpose(program, rank)
    width = max((len(k) for k in grouped), default=0)
    lines += [f"  {key:<{width}}  {count:>5} x  {format_bytes(moved):>10}" for key, (count, moved) in grouped.items()]
    lines += ["", program.estimate(hardware).table()]
    return "\n".join(lines)


def _buckets(program: CompiledProgram, rank: int) -> list[str]:
    if program.stages is None:
        sets = [("", program.buckets)]
    else:
        pp = program.mesh.coord(rank).pp
        sets = [(f"stage {s.index} ", s.buckets) for s in program.stages if program.schedule.rank_of(s.index) == pp]
    lines = []
    for where, buckets in sets:
        for b in buckets:
            span = b.parameters[0] + (f" .. {b.parameters[-1]}" if len(b.parameters) > 1 else "")
            lines.append(f"  {where}bucket {b.index}: {len(b.parameters)} tensors, {format_bytes(b.nbytes)}  ({span})")
    return lines or ["  none (nothing to reduce)"]
