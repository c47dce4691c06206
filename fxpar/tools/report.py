"""`program.report("plan.html")`: one self-contained HTML page that shows a plan.

    program.report("plan.html")                                   # rank 0's collectives
    write_report(program, "plan.html", rank=3, hardware="a100", compare=other_program,
                 timeline=measured_timelines, memory=measured_memory)

The page holds, top to bottom: the plan and its mesh, the stage table and the schedule grid,
the partitioned graph (`fxpar.pictures.visualize`, module detail), the pipeline step as a Gantt chart
(the estimate's simulation, beside a measured `runner.timeline()` per rank when given), memory
per rank (`fxpar.pictures.rank_memory`, against measured figures when given), the estimate with the
formula behind each number, the collectives of one rank in issue order, and, with `compare`,
the table of `fxpar.diff`.

Self-contained: every picture is inline SVG (graphviz's and matplotlib's, whose text is drawn
as paths, so no font is fetched), the style sheet is inline, and there is no script, link,
image URL or web font; the page renders the same with the network off. Every piece of text
from the model or plan is HTML-escaped.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path

import sympy

from fxpar.ir.compiled_program import CompiledProgram
from fxpar.pictures.charts import Timeline, figure_svg, memory_figure, schedule_figure
from fxpar.pictures.payloads import axis_name, dtype_name, format_bytes
from fxpar.pictures.picture import build_picture
from fxpar.pictures.rank_memory import predicted_memory
from fxpar.pictures.visualize import render
from fxpar.tools.diff import diff

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.number { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f8f8f8; padding: 0.6em; overflow-x: auto; font-size: 0.8em; }
.picture { overflow: auto; max-height: 900px; border: 1px solid #eee; }
.picture svg { max-width: 100%; height: auto; }
.note { color: #666; font-size: 0.85em; }
"""


def write_report(
    program: CompiledProgram,
    path: str | Path,
    *,
    rank: int = 0,
    hardware: str = "h100",
    compare: CompiledProgram | None = None,
    timeline: Sequence[Timeline] | None = None,
    memory: Mapping[int, Mapping[str, float]] | None = None,
) -> Path:
    """Write the report of `program` to `path` (see module doc); returns the path.

    `rank` picks whose collectives are listed; `hardware` the profile of the estimate;
    `compare` another program of the same model to diff against; `timeline` each pipeline
    rank's measured `runner.timeline()` and `memory` each rank's `runner.memory_stats()` (or
    any of the terms of `fxpar.pictures.rank_memory.TERMS`, and `peak`) to draw beside the predictions.
    """
    program.mesh.coord(rank)  # raises ValueError naming the mesh's ranks
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"the report is one HTML page: name it with .html, not {str(path)!r}")
    path.write_text(report_html(program, rank=rank, hardware=hardware, compare=compare,
                                timeline=timeline, memory=memory), encoding="utf-8")
    return path


def report_html(
    program: CompiledProgram,
    *,
    rank: int = 0,
    hardware: str = "h100",
    compare: CompiledProgram | None = None,
    timeline: Sequence[Timeline] | None = None,
    memory: Mapping[int, Mapping[str, float]] | None = None,
) -> str:
    """The report page as a string."""
    estimate = program.estimate(hardware)
    title = f"fxpar plan '{program.plan}'"
    sections = [
        f"<h1>{_e(title)}</h1>",
        _section("The plan", _plan(program)),
        _section("Stages", _stages(program)),
        _section("The partitioned graph", _graph(program)),
        _section("The pipeline schedule", _schedule(estimate, timeline)),
        _section("Memory per rank", _memory(program, memory)),
        _section(f"The estimate on {hardware}", _estimate(estimate)),
        _section(f"Collectives of rank {rank} in one step", _collectives(program, rank)),
    ]
    if compare is not None:
        sections.append(_section(f"Compared with plan '{compare.plan}'", _diff(program, compare, rank, hardware)))
    body = "\n".join(sections)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{_e(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _section(heading: str, content: str) -> str:
    anchor = heading.lower().split()[1] if len(heading.split()) > 1 else heading.lower()
    return f'<section id="{_e(anchor)}">\n<h2>{_e(heading)}</h2>\n{content}\n</section>'


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], *, numbers: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    lines = []
    for row in rows:
        cells = "".join(f'<td class="number">{_e(c)}</td>' if i in numbers else f"<td>{_e(c)}</td>"
                        for i, c in enumerate(row))
        lines.append(f"<tr>{cells}</tr>")
    return f"<table>\n<tr>{head}</tr>\n" + "\n".join(lines) + "\n</table>"


def _pre(text: str) -> str:
    return f"<pre>{_e(text)}</pre>"


def _plan(program: CompiledProgram) -> str:
    captured = program.captured
    facts = [
        ("plan", str(program.plan)),
        ("mesh", f"{program.mesh}, {program.world_size} ranks (rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i)"),
        ("parameters", f"{captured.parameter_count():,}"),
        ("inputs", ", ".join(f"{n} {tuple(s)}" for n, s in zip(captured.input_names, captured.example_shapes))),
    ]
    if program.plan.zero in (2, 3) and program.plan.dp > 1:  # what ZeRO leaves the cost model to decide
        facts.append(("ZeRO reductions", str(program.zero_reduce)))
    fields = [(k, v) for k, v in program.plan.to_dict().items()]
    return (_table(("", ""), facts) + "\n<p class=\"note\">Every field of the plan:</p>\n"
            + _table(("field", "value"), fields) + "\n" + _pre(program.mesh.describe(max_ranks=16)))


def _stages(program: CompiledProgram) -> str:
    if program.stages is None:
        buckets = program.buckets
        rows = [(b.index, len(b.parameters), f"{b.numel:,}", dtype_name(b.dtype), format_bytes(b.nbytes),
                 f"{b.parameters[0]} .. {b.parameters[-1]}") for b in buckets]
        return ('<p class="note">No pipeline (pp=1): every rank runs the whole graph. Its gradient '
                "buckets, in launch order:</p>\n"
                + _table(("bucket", "tensors", "elements", "dtype", "bytes", "parameters"), rows, numbers=(0, 1, 2, 4)))
    return _pre(program.describe_stages()) + "\n<p class=\"note\">The schedule, one column per time slot:</p>\n" + _pre(str(program.schedule))


def _graph(program: CompiledProgram) -> str:
    svg = _inline(render(build_picture(program), "svg").decode("utf-8"))
    return ('<p class="note">Module detail, global view (<code>program.visualize("plan.svg")</code>; '
            "<code>rank=r</code> draws one rank, <code>detail=\"node\"</code> the aten nodes).</p>\n"
            f'<div class="picture">{svg}</div>')


def _schedule(estimate, timeline: Sequence[Timeline] | None) -> str:
    if estimate.pipeline is None:
        return '<p class="note">No pipeline: there is no schedule to draw.</p>'
    figure = schedule_figure(estimate.pipeline, measured=timeline,
                             title=f"one step on {estimate.hardware}, simulated with the estimate's stage times")
    note = "" if timeline is not None else ('<p class="note">Measured: pass each rank\'s '
                                            "<code>runner.timeline()</code> to draw it beside.</p>\n")
    return note + f'<div class="picture">{_inline(figure_svg(figure))}</div>'


def _memory(program: CompiledProgram, measured: Mapping[int, Mapping[str, float]] | None) -> str:
    predicted = predicted_memory(program)
    figure = memory_figure(predicted, measured=measured)
    rows = [(f"rank {r}", *(format_bytes(terms[k]) for k in ("params", "grads", "optimizer", "activations",
                                                            "workspace", "total"))) for r, terms in predicted.items()]
    table = _table(("rank", "params", "grads", "optimizer", "activations", "workspace", "peak"), rows,
                   numbers=range(1, 7))
    return (f'<div class="picture">{_inline(figure_svg(figure))}</div>\n<p class="note">One rank per '
            "pipeline coordinate; its data- and tensor-parallel peers hold the same.</p>\n" + table)


def _estimate(estimate) -> str:
    rows = []
    for group in ("flops", "memory", "time"):
        for key, value in getattr(estimate, group).items():
            formula = estimate.formulas.get(f"{group}.{key}")
            shown = "" if formula is None or sympy.sympify(formula).is_number else str(formula)
            rows.append((f"{group}.{key}" + (" (peak)" if (group, key) == ("memory", "total") else ""),
                         _value(group, value), shown))
    for kind, entry in estimate.comm.items():
        rows.append((f"comm.{kind}", f"{entry['count']:.0f} calls",
                     f"payload {format_bytes(entry['payload_bytes'])}, wire {format_bytes(entry['wire_bytes'])}"))
    rows.append(("MFU at the predicted time", f"{100 * estimate.mfu():.1f}%", ""))
    sizes = ", ".join(f"{k}={v}" for k, v in estimate.sizes.items())
    return (f'<p class="note">Rank {estimate.rank} of {estimate.world_size} (the one with the largest peak), '
            f"{estimate.optimizer}, at {_e(sizes)}; formulas in <code>batch</code> (the global batch) and "
            "<code>seq</code>.</p>\n" + _table(("quantity", "value", "formula"), rows, numbers=(1,)))


def _value(group: str, value: float) -> str:
    if group == "memory":
        return format_bytes(value)
    if group == "time":
        return f"{value * 1e3:.3f} ms"
    return format_bytes(value).replace("B", "FLOP")


def _collectives(program: CompiledProgram, rank: int) -> str:
    calls = program.collectives(rank)
    if not calls:
        return f'<p class="note">Rank {rank} communicates nothing in a step.</p>'
    rows = [(i, c.kind, axis_name(program.mesh, rank, c.group), " ".join(map(str, c.group)), f"{c.numel:,}",
             dtype_name(c.dtype), format_bytes(c.payload_bytes), c.op, c.phase, c.tag) for i, c in enumerate(calls)]
    total = format_bytes(sum(c.payload_bytes for c in calls))
    return (f'<p class="note">{len(calls)} calls, {total} of payload, in the order rank {rank} issues them '
            "(<code>program.collectives(rank)</code>).</p>\n"
            + _table(("#", "kind", "axis", "group", "elements", "dtype", "bytes", "op", "phase", "tag"), rows,
                     numbers=(0, 4, 6)))


def _diff(program: CompiledProgram, compare: CompiledProgram, rank: int, hardware: str) -> str:
    change = diff(program, compare, rank=rank, hardware=hardware)
    rows = [(mark, f"{section}: {item}", before, after) for mark, section, item, before, after in change.table()]
    return ('<p class="note">+ only in the second plan, - only in this one, ~ changed (<code>fxpar.diff</code>).</p>\n'
            + _table(("", "what", f"'{change.before}'", f"'{change.after}'"), rows))


def _inline(svg: str) -> str:
    """An SVG document as an element of the page: no XML prolog, doctype or comments."""
    start = svg.index("<svg")
    return svg[start:].strip()
