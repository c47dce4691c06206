"""`program.visualize(path)`: the partitioned graph drawn by graphviz's `dot`.

    program.visualize("plan.svg")                        # the global view, one box per module
    program.visualize("rank3.png", rank=3)               # what rank 3 runs
    program.visualize("h3.pdf", detail="module", expand=["h.3"])   # h.3 opened to aten nodes
    print(dot_source(program))                           # the DOT text itself

What is drawn comes from `fxpar.pictures.picture` (boxes, arrows, stage clusters); this module only
turns it into DOT with the `graphviz` package and runs `dot`. Stages are coloured clusters;
collectives are shaped by what they do and coloured by their mesh axis (the legend is in the
picture's title).

[Note: nothing from the model reaches DOT unescaped] Module paths, parameter names and op
strings are the user's text. Node identifiers are generated (`b12`), and every piece of text
is placed in an HTML-like label after `html.escape` (control characters written as `\\xNN`),
the one DOT syntax in which quotes, braces, pipes, backslashes and angle brackets are plain
characters: a module named `a"<b>{c}` is drawn as exactly that and cannot end a label or start
a record field.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path

from fxpar.ir.compiled_program import CompiledProgram
from fxpar.pictures.picture import Box, Picture, build_picture
from fxpar.pictures.units import Detail

FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
SHAPES = {
    "all_reduce": "hexagon", "all_gather": "invtrapezium", "reduce_scatter": "trapezium",
    "all_to_all": "diamond",
    "slice": "parallelogram", "send": "cds", "recv": "cds", "broadcast": "triangle",
}
AXIS_COLOURS = {"tp": "#fdd0a2", "dp": "#c6dbef", "pp": "#c7e9c0"}
STAGE_COLOURS = ("#f7fbff", "#fff5eb", "#f7fcf5", "#fcfbfd", "#fff5f0", "#f0f0f0")
LEGEND = ("hexagon: all-reduce · trapezium: reduce-scatter · inverted trapezium: all-gather · "
          "diamond: all-to-all · arrow: send/recv · dashed border: backward only · bold: once per step · "
          "orange: tp, blue: dp, green: pp")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def visualize(
    program: CompiledProgram,
    path: str | Path,
    *,
    rank: int | None = None,
    detail: Detail = "module",
    expand: Sequence[str] = (),
) -> Path:
    """Render `program`'s graph to `path`; the suffix (.svg, .png, .pdf) picks the format.

    `rank=None` draws every stage (the global view), `rank=r` what rank r runs; `detail`
    is "module" (one box per module unit) or "node" (aten nodes); `expand` lists modules to
    open at node detail. Returns the path written. Raises ValueError for an unknown suffix or
    option, and RuntimeError naming the install command when graphviz's `dot` is missing.
    """
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot draw {str(path)!r}: the suffix picks the format; use one of "
                         f"{', '.join(FORMATS)}")
    picture = build_picture(program, rank=rank, detail=detail, expand=expand)
    path.write_bytes(render(picture, fmt))
    return path


def dot_source(
    program: CompiledProgram, *, rank: int | None = None, detail: Detail = "module", expand: Sequence[str] = ()
) -> str:
    """The DOT text `visualize` hands to `dot`."""
    return to_digraph(build_picture(program, rank=rank, detail=detail, expand=expand)).source


def render(picture: Picture, fmt: str) -> bytes:
    """`picture` run through graphviz's `dot`, as bytes of `fmt` ("svg", "png", "pdf")."""
    import graphviz

    try:
        return to_digraph(picture).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise RuntimeError(
            "graphviz's `dot` program is not installed (the Python package is, the renderer is "
            "not). Fix: `apt-get install graphviz` (Debian/Ubuntu), `brew install graphviz` "
            "(macOS) or `conda install graphviz`"
        ) from None


def to_digraph(picture: Picture):
    """The `graphviz.Digraph` of a picture: clusters per stage and expanded module."""
    import graphviz

    dot = graphviz.Digraph("fxpar")
    dot.attr(rankdir="TB", fontname="Helvetica", labelloc="t", nodesep="0.2", ranksep="0.3",
             label=_label(picture.title, (LEGEND,), size=10))
    dot.attr("node", fontname="Helvetica", fontsize="10", margin="0.08,0.03")
    dot.attr("edge", fontname="Helvetica", fontsize="8", color="#555555", fontcolor="#555555")
    placed: dict[tuple, list[Box]] = {}
    for box in picture.boxes:
        placed.setdefault((box.stage, box.expanded), []).append(box)
    stages = sorted({s for s, _ in placed if s is not None})
    for stage in stages:
        with dot.subgraph(name=f"cluster_stage_{stage}") as cluster:
            colour = STAGE_COLOURS[stage % len(STAGE_COLOURS)]
            cluster.attr(style="filled,rounded", fillcolor=colour, color="#999999",
                         label=_label(picture.stages.get(stage, f"stage {stage}"), ()))
            _add_boxes(cluster, placed, stage)
    _add_boxes(dot, placed, None)
    for arrow in picture.arrows:
        style = {"style": "dashed", "arrowhead": "none"} if arrow.attached else {}
        label = {"label": _label("", (arrow.label,), size=8, bold=False)} if arrow.label else {}
        dot.edge(arrow.source, arrow.target, **label, **style)
    return dot


def _add_boxes(graph, placed: dict[tuple, list[Box]], stage: int | None) -> None:
    for box in placed.get((stage, None), []):
        graph.node(box.id, **_box_attributes(box))
    expanded = sorted({e for s, e in placed if s == stage and e is not None})
    for module in expanded:
        with graph.subgraph(name=f"cluster_module_{stage}_{expanded.index(module)}") as cluster:
            cluster.attr(style="dashed,rounded", color="#666666", label=_label(module, ("expanded",)))
            for box in placed[(stage, module)]:
                cluster.node(box.id, **_box_attributes(box))


def _box_attributes(box: Box) -> dict[str, str]:
    attributes = {"label": _label(box.title, box.lines), "style": "filled"}
    if box.kind in ("collective", "transfer", "step"):
        attributes["shape"] = SHAPES.get(box.primitive, "octagon")
        attributes["fillcolor"] = AXIS_COLOURS.get(box.axis.split("+")[0], "#e5e5e5")
        if box.backward_only:
            attributes["style"] = "filled,dashed"
        if box.kind == "step":
            attributes["style"] = "filled,bold"
        if attributes["shape"] == "cds":
            attributes["margin"] = "0.25,0.12"  # cds draws its label to its edges otherwise
    elif box.kind == "module":
        attributes.update(shape="box", style="filled,rounded", fillcolor="white")
    elif box.kind == "node":
        attributes.update(shape="box", fillcolor="white", fontsize="9")
    elif box.kind == "parameter":
        attributes.update(shape="note", fillcolor="#ffffe0", fontsize="8")
    elif box.kind == "input":
        attributes.update(shape="ellipse", fillcolor="#eeeeee")
    else:
        attributes.update(shape="doubleoctagon", fillcolor="#eeeeee")
    return attributes


def _label(title: str, lines: Sequence[str], *, size: int = 8, bold: bool = True) -> str:
    """An HTML-like label: the title in bold, then the lines in a smaller font (see Note)."""
    parts = [f"<b>{escape(title)}</b>"] if title and bold else [escape(title)] if title else []
    shown = [escape(line) for line in lines if line]
    if shown:
        parts.append(f'<font point-size="{size}">' + "<br/>".join(shown) + "</font>")
    return "<" + "<br/>".join(parts) + ">"


def escape(text: str) -> str:
    """Text safe inside an HTML-like DOT label, shown verbatim ([Note: nothing from the model
    reaches DOT unescaped])."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", str(text))
    return html.escape(text, quote=True).replace("\n", "<br/>").replace("\t", " ")
