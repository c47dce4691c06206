"""Charts of a plan with matplotlib: the pipeline schedule as a Gantt chart, memory per rank.

    sim = program.estimate("h100").pipeline                  # the simulated step, in seconds
    schedule_chart("1f1b.svg", sim)                          # one panel
    schedule_chart("1f1b.png", sim, measured=timelines)      # simulated | measured, side by side
    memory_chart("memory.svg", predicted_memory(program), measured={0: runner.memory_stats(), ...})

`measured` timelines are each pipeline rank's `runner.timeline()` (rows of (action text,
start, end) in `time.perf_counter` seconds), gathered in rank order, e.g. with
`torch.distributed.all_gather_object`; the charts draw what the text Gantt of `fxpar.schedule.gantt`
prints, as bars: forward blue, backward orange, zero bubble's weight gradient green, a chunk's
second virtual stage darker, the microbatch written in its bar.

Memory bars stack the parameters, gradients, optimizer state, activations and workspace of
each rank (`fxpar.pictures.rank_memory`), with the predicted peak marked; a measured rank gets a second,
hatched bar beside its prediction: the terms its mapping names (`runner.memory_stats()` gives
params, grads and optimizer) and a mark at its `peak` when there is one (the allocator's, on
CUDA), else a label of what the bar holds.

matplotlib is the optional `viz` extra (`pip install 'fxpar[viz]'`); figures are built on
`matplotlib.figure.Figure`, so no pyplot state or display is involved. The format follows the
suffix: .svg or .png (.pdf works too).
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from fxpar.pictures.payloads import format_bytes
from fxpar.pictures.rank_memory import TERMS
from fxpar.schedule.actions import Action
from fxpar.schedule.simulation import Simulation

KIND_COLOURS = {"F": ("#6baed6", "#2171b5"), "B": ("#fdae6b", "#d94801"), "W": ("#74c476", "#238b45")}
TERM_COLOURS = {"params": "#4292c6", "grads": "#fd8d3c", "optimizer": "#807dba",
                "activations": "#41ab5d", "workspace": "#bdbdbd"}
Timeline = Sequence[tuple[object, float, float]]


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "fxpar's charts need matplotlib, which is not installed. Fix: pip install 'fxpar[viz]' "
            "(or pip install 'matplotlib>=3.8')"
        ) from None
    return Figure(figsize=(width, height), layout="constrained")


def schedule_figure(simulated: Simulation, *, measured: Sequence[Timeline] | None = None, title: str = ""):
    """The Gantt figure: the simulated step, and beside it the measured one when given.

    Simulated times are seconds when every cost was (an estimate's `pipeline`), else the
    simulator's own units; measured ones are seconds, each panel drawn from its first start.
    """
    panels = [("simulated", simulated.timeline)] + ([("measured", measured)] if measured is not None else [])
    ranks = max(len(t) for _, t in panels)
    figure = _figure(6.5 * len(panels), 0.55 * ranks + 1.6)
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, timeline) in zip(axes, panels):
        unit = _draw_gantt(ax, timeline, virtual=simulated.schedule.v, seconds=name == "measured"
                           or _in_seconds(simulated))
        ax.set_title(f"{name}: {simulated.schedule.name}, p={simulated.schedule.p}, "
                     f"m={simulated.schedule.m}", fontsize=10)
        ax.set_xlabel(unit)
    axes[0].set_ylabel("pipeline rank")
    figure.suptitle(title or "pipeline schedule", fontsize=11)
    split = simulated.schedule.splits_backward
    handles = [_patch(KIND_COLOURS["F"][0], "forward"),
               _patch(KIND_COLOURS["B"][0], "backward: input gradient (B)" if split else "backward")]
    if split:
        handles.append(_patch(KIND_COLOURS["W"][0], "weight gradient (W)"))
    if simulated.schedule.v > 1:
        handles.append(_patch(KIND_COLOURS["F"][1], "darker: the rank's next virtual stage"))
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    return figure


def _in_seconds(simulated: Simulation) -> bool:
    """An estimate's simulation lasts well under a minute; a unit-cost one lasts >= 1 unit."""
    return isinstance(simulated.total, float) and simulated.total < 60


def _draw_gantt(ax, timeline: Sequence[Timeline], *, virtual: int, seconds: bool) -> str:
    rows = [[(_action(a), float(s), float(e)) for a, s, e in row] for row in timeline]
    origin = min((s for row in rows for _, s, _ in row), default=0.0)
    scale, unit = (1e3, "ms") if seconds else (1.0, "time (units of one forward)")
    end = max((e for row in rows for _, _, e in row), default=1.0)
    for rank, row in enumerate(rows):
        for action, start, stop in row:
            colour = KIND_COLOURS[action.kind][(action.stage // max(1, len(rows))) % 2 if virtual > 1 else 0]
            left, width = (start - origin) * scale, (stop - start) * scale
            ax.barh(rank, width, left=left, height=0.7, color=colour, edgecolor="white", linewidth=0.5)
            if width > 0.025 * (end - origin) * scale:
                ax.text(left + width / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, (end - origin) * scale)
    ax.grid(axis="x", alpha=0.3)
    return unit


def _action(action: object) -> Action:
    return action if isinstance(action, Action) else Action.parse(str(action))


def _patch(colour: str, label: str, **style):
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, label=label, **style)


def memory_figure(
    predicted: Mapping[int, Mapping[str, float]],
    *,
    measured: Mapping[int, Mapping[str, float]] | None = None,
    title: str = "",
):
    """Stacked bars of each rank's memory terms, predicted and (hatched) measured."""
    measured = measured or {}
    ranks = sorted(predicted)
    figure = _figure(max(6.0, 1.3 * len(ranks) + 3.5), 4.2)
    ax = figure.subplots()
    width = 0.38 if measured else 0.6
    peak = max(max(_peak(t) or 0.0, sum(float(t.get(k, 0.0)) for k in TERMS))
               for t in [*predicted.values(), *measured.values()])
    for i, rank in enumerate(ranks):
        bars = [(i - width / 2 if measured else i, predicted[rank], "", "predicted")]
        if rank in measured:
            bars.append((i + width / 2, measured[rank], "//", "measured"))
        for x, terms, hatch, _ in bars:
            bottom = 0.0
            for term in TERMS:
                value = float(terms.get(term, 0.0))
                ax.bar(x, value / 1e6, width, bottom=bottom / 1e6, color=TERM_COLOURS[term], hatch=hatch,
                       edgecolor="white", linewidth=0.5)
                bottom += value
            top = _peak(terms)
            if top is not None:
                ax.plot([x - width / 2, x + width / 2], [top / 1e6] * 2, color="black", linewidth=1.5)
            label = format_bytes(top) if top is not None else f"{format_bytes(bottom)} held"
            ax.text(x, max(top or 0.0, bottom) / 1e6 + 0.01 * peak / 1e6, label, ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylabel("MB per rank")
    ax.set_ylim(0, 1.12 * peak / 1e6 if peak else 1)
    handles = [_patch(TERM_COLOURS[t], t) for t in TERMS]
    handles.append(_patch("white", "peak (black mark)", edgecolor="black"))
    if measured:
        handles.append(_patch("white", "measured (hatched)", hatch="//", edgecolor="black"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    figure.suptitle(textwrap.fill(title or "memory per rank (predicted)", int(11 * figure.get_figwidth())),
                    fontsize=10)
    return figure


def _peak(terms: Mapping[str, float]) -> float | None:
    """The peak a bar is marked at: its `total` (a prediction) or `peak` (a measurement)."""
    value = terms.get("total", terms.get("peak"))
    return None if value is None else float(value)


def save_figure(figure, path: str | Path) -> Path:
    """Write a figure; the suffix picks the format. SVG keeps its text as paths (no fonts)."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("svg", "png", "pdf"):
        raise ValueError(f"cannot save a chart as {str(path)!r}: use a .svg, .png or .pdf suffix")
    figure.savefig(path, format=fmt, dpi=150, metadata=_metadata(fmt))
    return path


def figure_svg(figure) -> str:
    """The figure as SVG text, for inlining in a page (no XML prolog)."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata=_metadata("svg"))
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _metadata(fmt: str) -> dict:
    """No creation date, so the same plan draws the same file (pictures in docs/ diff cleanly),
    and no RDF block in SVG, whose namespace URLs would be the page's only links."""
    empty = {"Creator": None, "Date": None, "Format": None, "Type": None}
    return {"svg": empty, "pdf": {"CreationDate": None}}.get(fmt, {})


def schedule_chart(path: str | Path, simulated: Simulation, *, measured: Sequence[Timeline] | None = None,
                   title: str = "") -> Path:
    """Write `schedule_figure(...)` to `path` (.svg or .png)."""
    return save_figure(schedule_figure(simulated, measured=measured, title=title), path)


def memory_chart(path: str | Path, predicted: Mapping[int, Mapping[str, float]], *,
                 measured: Mapping[int, Mapping[str, float]] | None = None, title: str = "") -> Path:
    """Write `memory_figure(...)` to `path` (.svg or .png)."""
    return save_figure(memory_figure(predicted, measured=measured, title=title), path)
