"""A pipeline step as a text Gantt chart: one line per rank, time running left to right.

Both timelines fxpar produces render the same way, so a measured step and its simulation can
be read one above the other:

    simulated = simulate(program.schedule, F, B)            # fxpar.schedule.simulation
    print(gantt(simulated.timeline))
    print(gantt(gathered))   # each rank's runner.timeline(), e.g. via all_gather_object

    rank 0 |F00F1......B0000F22B1111F33B2222...B3333|      1F1B, p=2, m=4, F=1, B=2
    rank 1 |...F0B00000F1B11111F2B22222F3B33333.....|
            0                                   15.0

Each column is an equal slice of the step. An action starts with its kind (F, B or W) and
fills the columns it lasts with its microbatch's last digit; "." is idle. Times are relative
to the earliest start.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxpar.schedule.schedules import Action


def gantt(timelines: Sequence[Sequence[tuple]], *, width: int = 80, unit: str = "ms") -> str:
    """Render per-rank rows of (action, start, end); action an `Action` or its text "1F0".

    `width` is the number of columns for the whole step; `unit` ("ms" or "s") labels the axis
    when start and end are in seconds (measured timelines); unit-cost simulations print their
    own units as they are with unit="".
    """
    if width < 10:
        raise ValueError(f"width={width}: a Gantt chart needs at least 10 columns")
    rows = [[(_action(a), float(s), float(e)) for a, s, e in timeline] for timeline in timelines]
    spans = [(s, e) for row in rows for _, s, e in row]
    if not spans:
        return "(no actions)"
    origin = min(s for s, _ in spans)
    total = max(e for _, e in spans) - origin or 1.0
    slice_ = total / width
    lines = []
    for rank, row in enumerate(rows):
        cells = ["."] * width
        for action, start, end in row:
            first = int((start - origin) / slice_ + 0.5)
            last = max(first, int((end - origin) / slice_ + 0.5) - 1)
            digit = str(action.microbatch)[-1]
            for column in range(first, min(last, width - 1) + 1):
                cells[column] = action.kind if column == first else digit
        lines.append(f"rank {rank} |{''.join(cells)}|")
    scale = {"ms": 1e3, "s": 1.0, "": 1.0}[unit]
    end_label = f"{total * scale:.1f} {unit}".strip()
    start_label = f"0 {unit}".strip()
    pad = " " * len(f"rank {len(rows) - 1} |")
    lines.append(pad + start_label + " " + end_label.rjust(width - len(start_label) - 1))
    return "\n".join(lines)


def _action(action: Action | str) -> Action:
    return action if isinstance(action, Action) else Action.parse(action)
