"""The boxes of a picture and what the communicating ones say.

A `Box` is one drawn node (`fxpar.pictures.picture` assembles them). The two that stand for the
graph's own communication are labelled here, each with the calls it stands for (`BoxCall`: the
tag, kind and payload `program.collectives(r)` lists):

    collective_box   a torch.ops.fxpar op: its forward and backward collectives, as the op's
                     description says (`fxpar.ops.distributed`), each with its payload: an
                     all-gather's output, any other collective's input (backward swaps them)
    transfer_box     a tensor crossing a pipeline cut: stage s's activations forward and
                     stage s-1's gradients backward, one send/recv pair each per microbatch

Payloads are formulas in `batch` and `seq`, then bytes at the example's size (`payloads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.mesh import Axis
from fxpar.ops.distributed import COMMUNICATING, axis_of, distributed_op
from fxpar.pictures.payloads import example_numel, payload_formula, payload_text, shape_text

BoxKind = Literal["input", "module", "node", "parameter", "collective", "transfer", "step", "output"]


@dataclass(frozen=True)
class BoxCall:
    """One call a box stands for, as `program.collectives(r)` lists it: its tag and kind, and
    its payload at the example's sizes (per microbatch for graph ops and transfers)."""

    tag: str
    kind: str
    payload_bytes: int


@dataclass(frozen=True, kw_only=True)
class Box:
    """One drawn node. `id` is generated ("b12"), never user text, so it is safe in DOT."""

    id: str = ""
    kind: BoxKind
    title: str
    lines: tuple[str, ...] = ()
    stage: int | None = None  # the stage cluster it is drawn in
    expanded: str | None = None  # the expanded module whose cluster it is drawn in
    axis: str = ""  # collectives and transfers: the mesh axis they communicate on
    primitive: str = ""  # all_reduce, all_gather, reduce_scatter, send, ...: the box's shape
    backward_only: bool = False  # communicates only in backward (Megatron's f): dashed border
    calls: tuple[BoxCall, ...] = ()  # collectives and transfers: the calls it stands for

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.tag for c in self.calls))


def collective_box(program: CompiledProgram, node: fx.Node, *, rank: int | None, **placed) -> Box:
    """The box of a distributed op's node; `placed` gives its stage and expanded module."""
    op, axis = distributed_op(node), axis_of(node)
    mesh, captured = program.mesh, program.captured
    sources = op.sources(node)  # a ZeRO-3 op's: one flat payload of them all
    lines, calls = [], []
    if rank is not None:
        lines.append(f"ranks {list(mesh.group(rank, Axis(axis)))}")

    def payload(value: fx.Node):
        return payload_formula(captured, value.meta["val"].shape, meta.placements(value), sizes=mesh.sizes,
                               microbatches=program.plan.microbatches)

    for phase in ("forward", "backward"):
        primitive = op.primitive(phase)
        if primitive not in COMMUNICATING or (phase == "backward" and not any(map(meta.requires_grad, sources))):
            continue
        whole_end = (primitive == "all_gather") == (phase == "forward")  # the op's output side
        if op.many:  # the gathered values forward, their gradients backward: all ranks' pieces
            formula = sum(payload(s) for s in sources) * mesh.size(Axis(axis))
        else:
            formula = payload(node if whole_end else sources[0])
        numel = example_numel(captured, formula)
        dtype = op.payload_dtype(node, phase)  # as the step program's call (`lowering.graph_calls`)
        calls.append(BoxCall(op.tag(axis, phase), primitive, numel * dtype.itemsize))
        lines += [calls[-1].tag, f"{primitive} {payload_text(formula, numel=numel, dtype=dtype)}"]
    lines += per_step(program, bool(calls))
    return Box(kind="collective", title=f"{op.name} · {axis}", lines=tuple(lines), axis=axis,
               primitive=calls[0].kind if calls else "slice",
               backward_only=op.primitive("forward") not in COMMUNICATING, calls=tuple(calls), **placed)


def transfer_box(program: CompiledProgram, boundary, stage: int, *, rank: int | None) -> Box:
    """The send/recv box of `boundary` (`passes.pipeline.Boundary`) received by `stage`."""
    mesh, captured = program.mesh, program.captured
    formula = payload_formula(captured, boundary.shape, boundary.placement, sizes=mesh.sizes,
                              microbatches=program.plan.microbatches)
    numel = example_numel(captured, formula)
    tags = [f"stage {stage} activations"] + ([f"stage {stage - 1} gradients"] if boundary.requires_grad else [])
    if rank is None:
        where = f"stage {stage - 1} -> stage {stage}"
    else:
        coord, schedule = mesh.coord(rank), program.schedule
        a, b = (mesh.rank_of(dp=coord.dp, pp=schedule.rank_of(s), tp=coord.tp, cp=coord.cp) for s in (stage - 1, stage))
        where = f"rank {a} -> rank {b}"
    text = payload_text(formula, numel=numel, dtype=boundary.dtype)
    lines = [f"{where}: {shape_text(captured, boundary.shape)}", f"{tags[0]} (forward)"]
    if len(tags) > 1:
        lines.append(f"{tags[1]} (backward)")
    lines += [f"send/recv {text}" + (" each way" if len(tags) > 1 else ""), *per_step(program, True)]
    calls = tuple(BoxCall(t, "send", numel * boundary.dtype.itemsize) for t in tags)
    return Box(kind="transfer", title="send / recv · pp", lines=tuple(lines), axis="pp", primitive="send",
               calls=calls)


def per_step(program: CompiledProgram, communicates: bool) -> list[str]:
    """"x4 per step" when a microbatch's call repeats for each of the step's microbatches."""
    microbatches = program.plan.microbatches
    return [f"x{microbatches} per step (per microbatch)"] if communicates and microbatches > 1 else []
