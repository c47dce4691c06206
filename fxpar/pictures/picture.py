"""The partitioned graph as a picture, before any drawing: boxes, arrows and stage clusters.

`build_picture(program, rank=None, detail="module", expand=())` reads a compiled Program and
returns a `Picture`, plain data that `fxpar.pictures.visualize` hands to graphviz and that tests read
without rendering. What becomes a box:

    box kind     one per                                        drawn as
    input        tensor input of the step                       ellipse
    module       module unit and stage (`picture_units`)        box
    node         aten node (detail="node", or an expanded one)  box, small
    parameter    parameter (detail="node" only)                 note
    collective   torch.ops.fxpar op the passes inserted         by primitive, on its mesh axis
    transfer     tensor crossing a pipeline cut (send/recv)     cds
    step         what the step program's `Communicate`         by primitive, hung on the box
                 actions issue, one box per purpose: a          it follows (dashed arrow)
                 gradient bucket's calls (ZeRO's gathers and
                 reduce-scatters too), the count of valid
                 targets, a tied parameter's sum, the losses
    output       the loss                                       double octagon

Arrows are data flow between boxes, labelled with the value's placement on each mesh axis
(`payloads.placement_text`); a cut's crossing is drawn through its transfer box. Every
collective and transfer box lists the tags its calls carry in `program.collectives(r)` with
their kind, axis and payload (formula in `batch` and `seq`, then bytes at the example's size).

`rank=None` draws the global view: every stage, and the step collectives of one rank per
pipeline coordinate (dp and tp peers issue the same ones). `rank=r` draws what rank r runs:
its stages, its groups' ranks, its peers. `Box` and the labels of the communicating boxes
are in `fxpar.pictures.boxes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.collectives import Collective
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.placement import local_numel
from fxpar.ir.step_program import Communicate, Purpose
from fxpar.pictures.boxes import Box, BoxKind, BoxCall, collective_box, transfer_box
from fxpar.pictures.payloads import axis_name, payload_text, placement_text, shape_text
from fxpar.pictures.transfers import crossings
from fxpar.pictures.units import Detail, Unit, assign_units, check_expand


@dataclass(frozen=True)
class Arrow:
    """An edge between two boxes (their ids), labelled with the value's placements."""

    source: str
    target: str
    label: str = ""
    attached: bool = False  # a step collective hung on the box it follows, not data flow


@dataclass(frozen=True, kw_only=True)
class Picture:
    """Everything `fxpar.pictures.visualize` draws: boxes in drawing order, arrows, stage clusters."""

    title: str
    boxes: tuple[Box, ...]
    arrows: tuple[Arrow, ...]
    stages: dict[int, str] = field(default_factory=dict)  # stage -> its cluster's label

    def find(self, kind: BoxKind) -> list[Box]:
        """The boxes of one kind, in drawing order."""
        return [b for b in self.boxes if b.kind == kind]


def build_picture(
    program: CompiledProgram,
    *,
    rank: int | None = None,
    detail: Detail = "module",
    expand: Sequence[str] = (),
) -> Picture:
    """The picture of `program` (see module doc). Raises ValueError for an unknown `detail`,
    a rank not on the mesh, or an `expand` entry that names no module."""
    if detail not in ("module", "node"):
        raise ValueError(f"detail={detail!r}: choose 'module' (one box per module) or 'node' (aten nodes)")
    if rank is not None:
        program.mesh.coord(rank)  # raises ValueError naming the mesh's ranks
    check_expand(program.graph_module.graph, expand)
    return _Builder(program, rank, detail, tuple(expand)).build()


class _Builder:
    def __init__(self, program: CompiledProgram, rank: int | None, detail: Detail, expand: tuple[str, ...]):
        self.program, self.rank, self.detail, self.expand = program, rank, detail, expand
        self.mesh, self.captured = program.mesh, program.captured
        self.graph = program.graph_module.graph
        schedule = program.schedule
        if program.stages is None or rank is None:
            self.shown = None if program.stages is None else set(range(len(program.stages)))
        else:
            pp = self.mesh.coord(rank).pp
            self.shown = {s.index for s in program.stages if schedule.rank_of(s.index) == pp}
        self.boxes: dict[object, Box] = {}  # Unit or another key -> its box
        self.arrows: dict[tuple[str, str], Arrow] = {}

    # -- the graph's boxes --------------------------------------------------------------------

    def build(self) -> Picture:
        every = assign_units(self.graph, detail=self.detail, expand=self.expand,
                             pipelined=self.program.stages is not None)
        units = {n: u for n, u in every.items() if self._drawn(u)}
        members: dict[Unit, list[fx.Node]] = {}
        for node, unit in units.items():
            members.setdefault(unit, []).append(node)
        for unit, nodes in members.items():
            self._add(unit, self._unit_box(unit, nodes))
        if self.program.stages is not None:
            for crossing in crossings(self.program).values():
                if crossing.source_stage in self.shown or crossing.stage in self.shown:
                    self._add(crossing.key, transfer_box(self.program, crossing.boundary, crossing.stage,
                                                         rank=self.rank))
        for node, unit in units.items():
            for source in node.all_input_nodes:
                if source in every and every[source] != unit:
                    self._connect(source, every[source], unit, drawn=source in units)
        self._add_step_collectives(units)
        self._place_parameters()
        used = {a.source for a in self.arrows.values()} | {a.target for a in self.arrows.values()}
        boxes = [b for b in self.boxes.values() if b.kind not in ("input", "parameter") or b.id in used]
        return Picture(title=self._title(), boxes=tuple(boxes), arrows=tuple(self.arrows.values()),
                       stages=self._stage_labels())

    def _place_parameters(self) -> None:
        """A parameter box is drawn in the stage (and expanded module) of its first reader."""
        keys = {b.id: key for key, b in self.boxes.items()}
        placed = set()
        for arrow in self.arrows.values():
            key, reader = keys[arrow.source], self.boxes[keys[arrow.target]]
            box = self.boxes[key]
            if box.kind == "parameter" and key not in placed:
                placed.add(key)
                expanded = box.expanded if box.expanded == reader.expanded else None
                self.boxes[key] = replace(box, stage=reader.stage, expanded=expanded)

    def _drawn(self, unit: Unit) -> bool:
        if unit.kind == "output":
            return self.rank is None or self.program.holds_loss(self.rank)
        return unit.stage is None or self.shown is None or unit.stage in self.shown

    def _add(self, key: object, box: Box) -> Box:
        self.boxes[key] = replace(box, id=f"b{len(self.boxes)}")
        return self.boxes[key]

    def _arrow(self, source: Box, target: Box, label: str = "", *, attached: bool = False) -> None:
        key = (source.id, target.id)
        if key in self.arrows and label and label not in self.arrows[key].label.split(" | "):
            label = f"{self.arrows[key].label} | {label}" if self.arrows[key].label else label
        elif key in self.arrows:
            label = self.arrows[key].label
        self.arrows[key] = Arrow(source.id, target.id, label, attached)

    def _connect(self, source: fx.Node, source_unit: Unit, unit: Unit, *, drawn: bool) -> None:
        """Arrows from `source`'s box to `unit`'s, through a transfer box per cut crossed."""
        path = [self.boxes[source_unit]] if drawn else []
        start, end = source_unit.stage, unit.stage
        if source_unit.kind not in ("input", "parameter") and start is not None and end is not None:
            # A cut whose sides are both on other ranks has no box: the arrow skips it.
            path += [self.boxes[(source, s)] for s in range(start + 1, end + 1) if (source, s) in self.boxes]
        path.append(self.boxes[unit])
        label = placement_text(source, self.mesh)
        for a, b in zip(path, path[1:]):
            self._arrow(a, b, label)

    def _unit_box(self, unit: Unit, nodes: list[fx.Node]) -> Box:
        common = dict(stage=unit.stage, expanded=unit.expanded)
        if unit.kind == "collective":
            return collective_box(self.program, nodes[0], rank=self.rank, **common)
        if unit.kind in ("input", "parameter"):
            node = nodes[0]
            value = node.meta["val"]
            return Box(kind=unit.kind, title=unit.name, lines=(
                f"{shape_text(self.captured, value.shape)} {value.dtype}".replace("torch.", ""),
                placement_text(node, self.mesh)), **common)
        if unit.kind == "output":
            return Box(kind="output", title="loss", lines=("the step's output",), **common)
        if unit.kind == "node":
            node = nodes[0]
            value = node.meta["val"]
            shape = shape_text(self.captured, value.shape) if hasattr(value, "shape") else "(tuple)"
            return Box(kind="node", title=node.name, lines=(_op_name(node), shape), **common)
        read = {meta.parameter_name(p) or p.name: p for n in nodes for p in n.all_input_nodes
                if p.op == "get_attr"}
        sizes = self.mesh.sizes if self.rank is not None else {}  # a rank's pieces, or whole
        params = sum(local_numel(p.meta["val"].shape, meta.placements(p), sizes) for p in read.values())
        where = " on this rank" if self.rank is not None and self.mesh.world_size > 1 else ""
        lines = [f"{len(nodes)} aten ops, {params:,} parameters{where}"]
        if unit.name.startswith("top-level ops"):
            lines.append(", ".join(dict.fromkeys(_op_name(n) for n in nodes[:6])))
        return Box(kind="module", title=unit.name, lines=tuple(lines), **common)

    # -- collectives that no graph node runs -------------------------------------------------

    def _add_step_collectives(self, units: dict[fx.Node, Unit]) -> None:
        """A box per purpose of the step program's `Communicate` actions (a bucket's calls, a
        tied parameter's sum, the count, the losses), from one rank per shown pipeline rank:
        the graph's own calls (`Compute`) and the transfers (`Exchange`) have their boxes."""
        found: dict[tuple, tuple[int, Communicate, list[Collective]]] = {}
        for rank in self._ranks():
            resolved = iter(self.program.collectives(rank))  # the step program's calls, in order
            for action in self.program.step_program(rank).actions:
                calls = [next(resolved) for _ in action.calls]
                if not isinstance(action, Communicate):
                    continue
                key = self._step_key(action)
                first = found.setdefault(key, (rank, action, []))
                if first[0] == rank:  # the same purpose on another pipeline rank is drawn once
                    first[2].extend(calls)
        for key, (rank, action, calls) in found.items():
            if key[0] == "bucket":
                self._bucket_box(rank, key[1], key[2], calls, units)
            else:
                self._step_box(rank, action, calls, units)

    def _step_key(self, action: Communicate) -> tuple:
        stage = action.stage if self.program.stages is not None else None
        if action.purpose in (Purpose.GRADIENT_BUCKET, Purpose.UPDATED_PARAMETERS):
            return ("bucket", stage, action.index)
        if action.purpose is Purpose.TIED_GRADIENT:
            return ("tied", action.name)
        if action.purpose is Purpose.STEP_AGREEMENT:  # one per axis
            return ("step", action.purpose, action.calls[0].axis)
        return ("step", action.purpose, stage if action.purpose is Purpose.PARTIAL_GRADIENTS else None)

    def _ranks(self) -> list[int]:
        if self.rank is not None:
            return [self.rank]
        return [self.mesh.rank_of(pp=i) for i in range(self.mesh.pp)]

    def _bucket_box(self, rank: int, stage: int | None, index: int, calls: list[Collective], units) -> None:
        buckets = self.program.buckets if stage is None else self.program.stages[stage].buckets
        names = buckets[index].parameters
        lines = [f"{len(names)} parameters: {names[0]}" + (f" .. {names[-1]}" if len(names) > 1 else "")]
        for c in calls:
            lines += [f"{c.tag} ({c.phase})", f"{c.kind} {payload_text(c.numel, numel=c.numel, dtype=c.dtype)}"]
        if self.rank is not None:
            lines.insert(0, f"ranks {list(calls[0].group)}")
        reduction = next((c.kind for c in calls if c.kind != "all_gather"), calls[0].kind)
        box = self._add(("bucket", stage, index), Box(
            kind="step", title=f"gradient bucket {index} · {axis_name(self.mesh, rank, calls[0].group)}",
            lines=tuple(lines), stage=stage, axis="dp", primitive=reduction,
            calls=tuple(BoxCall(c.tag, c.kind, c.payload_bytes) for c in calls)))
        # Hung on the module reading the bucket's last parameter in gradient-ready order:
        # backward completes the bucket there, and its collective launches.
        for anchor in self._readers(names[-1], units, stage)[:1]:
            self._arrow(anchor, box, attached=True)

    def _step_box(self, rank: int, action: Communicate, calls: list[Collective], units) -> None:
        call = calls[0]
        axis = axis_name(self.mesh, rank, call.group)
        lines = [f"{call.kind} ({call.phase})", payload_text(call.numel, numel=call.numel, dtype=call.dtype)]
        if self.rank is not None:
            lines.insert(0, f"ranks {list(call.group)}")
        if len(calls) > 1:
            lines.append(f"x{len(calls)} per step")
        box = self._add(self._step_key(action), Box(
            kind="step", title=f"{call.tag} · {axis}", lines=tuple(lines), axis=axis,
            primitive=call.kind, calls=tuple(BoxCall(c.tag, c.kind, c.payload_bytes) for c in calls)))
        boxes = {u: b for u, b in self.boxes.items() if isinstance(u, Unit)}
        if action.purpose is Purpose.TIED_GRADIENT:
            anchors = self._readers(action.name, units, None)
        elif action.purpose is Purpose.VALID_TARGETS:  # the count becomes this input
            anchors = [b for u, b in boxes.items() if u.kind == "input" and u.name == self.program.input_names[-1]]
        elif action.purpose is Purpose.STEP_AGREEMENT:  # before the step's first input is read
            anchors = [b for u, b in boxes.items() if u.kind == "input"][:1]
        else:
            anchors = [b for u, b in boxes.items() if u.kind == "output"]
        if not anchors:  # the loss is on another rank: hang it on this rank's last box
            anchors = [b for u, b in boxes.items() if u.kind == "module"][-1:]
        for anchor in anchors:
            self._arrow(anchor, box, attached=True)

    def _readers(self, parameter: str, units: dict[fx.Node, Unit], stage: int | None) -> list[Box]:
        """The boxes that read `parameter` (in `stage`, when given), in graph order."""
        node = meta.parameter_nodes(self.graph).get(parameter)
        if node is None:
            return []
        readers = [units[u] for u in node.users if u in units]
        if node in units:  # detail="node": the parameter has its own box
            readers = [units[node]]
        found = [self.boxes[u] for u in readers if stage is None or u.stage == stage]
        return list(dict.fromkeys(found))

    # -- titles -------------------------------------------------------------------------------

    def _title(self) -> str:
        view = "global view"
        if self.rank is not None:
            view = f"rank {self.rank} ({self.mesh.position(self.rank)})"
        return f"plan '{self.program.plan}' on {self.mesh}: {view}, detail={self.detail}"

    def _stage_labels(self) -> dict[int, str]:
        if self.program.stages is None:
            return {}
        schedule = self.program.schedule
        return {s: f"stage {s} (pipeline rank {schedule.rank_of(s)})" for s in sorted(self.shown)}


def _op_name(node: fx.Node) -> str:
    """`linear` for aten.linear.default, `getitem` for operator.getitem."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))
