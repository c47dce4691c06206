"""Lowering: the compiled job -> each rank's step program (`fxpar.ir.step_program`).

A step program is the same for every rank of one pipeline row (ranks that differ only in
their dp and tp coordinates): `lower_row` builds that row's actions once, and `StepProgram`
resolves the axes to one rank's groups. Without a pipeline there is one row:

    VALID_TARGETS / STEP_AGREEMENT      ranks agree on the step, per axis; on dp the step's
                                        count rides along, on tp and pp the batch's identity
                                        (`step_start_actions`); where they can, dp's
                                        agreement and count ride in the first bucket
                                        (`ride_agreements`), with no call of their own
    F0 B0 F1 B1 ...                     each microbatch; its graph's calls (tp f and g, cp's
                                        key and value gathers, gathered again where
                                        backward recomputes attention)
    GRADIENT_BUCKET 0, 1, ...           in launch order (the last carries the loss)
    PARTIAL_GRADIENTS                   replicated parameters' partial tp (and cp) gradients

Under bf16-mixed the buckets are reduced in their `Bucket.reduced_dtype` and the loss, which
must reach the user in fp32, is all-reduced alone (`data_parallel.carries_loss`).

Under ZeRO-1/2 the buckets are reduce-scattered, the held ones (`Bucket.held`) after the
partial and tied sums, the loss is all-reduced alone, and the program's `optimizer` part
all-gathers each bucket's updated parameters. Under ZeRO-3 the graph's own ops gather each
layer's parameters and reduce-scatter its gradients (`passes.zero3`): they are the computes'
calls, and only the loss's all-reduce follows.

With a pipeline, the schedule's row for this pipeline rank, with an `Exchange` before each
compute action (the previous action's sends, the receives due: `issue_order`), then each
local stage's buckets in the order they complete, partial and tied gradients, and the loss
summed over the pipeline and over dp.

The reductions' actions (buckets, partial gradients, the loss, ZeRO's gathers) are
`fxpar.compiler.reduction_lowering`'s; what gathering the whole state issues, outside a step, is
`fxpar.compiler.full_state_lowering`'s.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import sympy
import torch
import torch.fx as fx

from fxpar.compiler.pipeline_program import issue_order, shared_parameters
from fxpar.compiler.reduction_lowering import (
    backward_calls, bucket_actions, loss_actions, optimizer_actions, partial_gradient_actions,
)
from fxpar.ir import meta
from fxpar.ir.mesh import LAYOUT, Axis, Mesh
from fxpar.ir.placement import local_numel, local_shape
from fxpar.ir.recompute_regions import segments
from fxpar.ir.stages import Boundary
from fxpar.ir.step_program import StepAction, Call, Communicate, Compute, Exchange, Purpose, Receive
from fxpar.ops.distributed import BY_NAME, COMMUNICATING, axis_of, distributed_op
from fxpar.passes.data_parallel import carries_loss
from fxpar.passes.weight_gradients import deferred_weights


def graph_calls(gm: fx.GraphModule, mesh: Mesh, *, prefetch: int = 0) -> tuple[tuple[Call, ...], tuple[Call, ...]]:
    """The calls of one microbatch's forward, and of its backward, of the graph's distributed
    ops, read off each op's own description (`fxpar.ops.distributed`).

    Backward calls are listed in reverse graph order, the order autograd runs them in, and
    only where a gradient flows. Payloads: an all-reduce's and a reduce-scatter's input, an
    all-gather's output, each a rank's piece (`placement.local_numel`); backward swaps input
    and output. An op on an axis of one rank moves nothing and is left out. ZeRO-3's gathers
    are issued `prefetch` layers ahead (`prefetched`).
    """
    forward: list[Call] = []
    backward: list[Call] = []
    spans: dict[fx.Node, tuple[int, int]] = {}  # a node -> its backward calls' (start, stop) in `backward`
    recomputed: dict[fx.Node, list[Call]] = {}  # a recomputed node -> its forward calls
    for node in gm.graph.nodes:
        op = distributed_op(node)
        if op is None:
            continue
        start = len(backward)
        axis = axis_of(node)
        if mesh.size(Axis(axis)) == 1:
            continue
        sources = op.sources(node)
        if op.many:  # ZeRO-3: every rank's pieces of all the sources, both ways
            whole = sum(_local_numel(s, mesh) for s in sources) * mesh.size(Axis(axis))
            ends = {"in": whole, "out": whole}
        else:
            ends = {"in": _local_numel(sources[0], mesh), "out": _local_numel(node, mesh)}
        for phase, calls, (payload_in, payload_out) in (
            ("forward", forward, ("in", "out")),
            ("backward", backward, ("out", "in")),
        ):
            primitive, dtype = op.primitive(phase), op.payload_dtype(node, phase)
            if primitive not in COMMUNICATING or (phase == "backward" and not any(map(meta.requires_grad, sources))):
                continue
            numel = ends[payload_out] if primitive == "all_gather" else ends[payload_in]
            reduce = "none" if primitive in ("all_gather", "all_to_all") else op.reduce
            calls.append(Call(kind=primitive, numel=numel, dtype=dtype, axis=axis, op=reduce,
                              tag=op.tag(axis, phase), phase=phase, where=meta.module_path(node), routed=op.routed))
            if phase == "forward" and meta.recompute_region(node) is not None:
                recomputed.setdefault(node, []).append(calls[-1])
        spans[node] = (start, len(backward))
    return (prefetched(forward, GATHER_TAG, prefetch),
            prefetched(_with_recomputation(backward, spans, recomputed, gm), REGATHER_TAG, prefetch))


def _with_recomputation(backward: list[Call], spans: dict, recomputed: dict, gm: fx.GraphModule) -> list[Call]:
    """`backward` in autograd's order (reversed), with each recomputed region's forward
    calls (context parallelism's gathers of keys and values: `recompute_regions`) where
    backward recomputes the region: when autograd first reaches it, before the first
    backward call of any of its nodes. `spans`: each node's backward calls, (start, stop)
    in graph order."""
    order, total, inserts = backward[::-1], len(backward), []
    for run in segments(gm.graph.nodes, meta.recompute_region):
        calls = [c for node in run for c in recomputed.get(node, ())]
        reached = [total - spans[n][1] for n in run if n in spans and spans[n][1] > spans[n][0]]
        if calls:
            inserts.append((min(reached, default=total), calls))
    for at, calls in sorted(inserts, key=lambda entry: -entry[0]):
        order[at:at] = calls
    return order


GATHER_TAG = BY_NAME["gather_parameters"].tag("dp", "forward")
REGATHER_TAG = BY_NAME["regather_parameters"].tag("dp", "backward")


def prefetched(calls: list[Call], tag: str, depth: int) -> tuple[Call, ...]:
    """`calls` with each gather of `tag` issued `depth` gathers early: when a layer's gather
    is due, the next `depth` layers' go out right after it (FSDP's prefetch), as the runtime's
    `ParameterGatherer` issues them. Their order among themselves stays; what moves is their
    place among the group's other calls (a layer's reduce-scatter in backward)."""
    gathers = [i for i, c in enumerate(calls) if c.tag == tag]
    rank = {position: k for k, position in enumerate(gathers)}
    issued: set[int] = set()
    out: list[Call] = []
    for i, call in enumerate(calls):
        if i not in rank:
            out.append(call)
            continue
        for k in range(rank[i], min(rank[i] + depth + 1, len(gathers))):
            if k not in issued:
                issued.add(k)
                out.append(calls[gathers[k]])
    return tuple(out)


def _local_numel(node: fx.Node, mesh: Mesh) -> sympy.Expr | int:
    """Elements of a rank's piece of `node`'s value, a formula in export's size symbols."""
    shape = [d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in node.meta["val"].shape]
    numel = local_numel(shape, meta.placements(node), mesh.sizes)
    return numel if isinstance(numel, int) else sympy.expand(numel)


def step_start_actions(mesh: Mesh, *, counted: bool, batch_dims: int) -> list[StepAction]:
    """What starts every step, before the first forward: on each mesh axis of more than one
    rank, one all-reduce by which the group's ranks agree on the step (`runtime.step.agreement`).

    Each rank of the group puts the number of its `runner.step` call in its own slot of an
    int64 vector of the group's size, zeros elsewhere, and the vector is summed: every rank
    then holds every member's step number, and fails naming both steps when they differ,
    before any of the step's data is reduced. On tp and pp, whose ranks must be given one
    batch, each member's step number is followed by a block of its own: the batch's
    fingerprint and the size of each dim of each input (`batch_dims` in all, fixed by the
    compiled inputs), so the call has one size whatever batch each rank was given and a rank
    given other rows, or other sizes, is named before any call whose size depends on them
    (`runtime.step.batch_identity`). On dp, where the loss is a sum over the step's count of valid
    targets (`passes.loss_normalisation`) and this rank computes the loss, the count rides in
    front of the slots (VALID_TARGETS): the all-reduce the step needed anyway carries the
    agreement; it may then ride in the first gradient bucket (`ride_agreements`).
    Every group a rank communicates on lies inside one of these axis groups (pipeline peers and
    tied-parameter owners inside its pp group), so checking the three before the first call of
    the step covers them all.
    """
    actions: list[StepAction] = []
    for axis in LAYOUT:
        n = mesh.size(axis)
        if n == 1:
            continue
        if axis is Axis.DP and counted:
            call = Call(kind="all_reduce", numel=1 + n, dtype=torch.int64, axis="dp",
                        tag="valid targets + step", phase="forward")
            actions.append(Communicate(Purpose.VALID_TARGETS, (call,)))
        else:
            batch = 1 + batch_dims if axis in SAME_BATCH else 0  # a fingerprint, then the sizes
            tag = f"step agreement on {axis.value}" + (" + batch" if batch else "")
            call = Call(kind="all_reduce", numel=n * (1 + batch), dtype=torch.int64, axis=axis.value,
                        tag=tag, phase="forward", batch=batch)
            actions.append(Communicate(Purpose.STEP_AGREEMENT, (call,)))
    return actions


# The axes whose ranks must be given one batch: tp's split one model's layers, pp's its depth,
# cp's its sequence.
SAME_BATCH = (Axis.TP, Axis.PP, Axis.CP)


def lower_row(program, pp: int, ahead: int, *, per_microbatch: bool
              ) -> tuple[tuple[StepAction, ...], tuple[StepAction, ...]]:
    """The actions of every rank on pipeline rank `pp` (module doc), those of `runner.step` and
    those around the optimizer step; `ahead`: how many actions ahead receives are posted
    (`pipeline_program.receives_ahead`); `per_microbatch`: whether ZeRO-2/3 reduce-scatter
    gradients per microbatch or per step (`fxpar.plan.zero_reduction`: the program's choice,
    or the mode it prices to make that choice)."""
    if program.stages is None:
        step, optimizer = _single_stage_row(program, per_microbatch)
    else:
        step, optimizer = _pipeline_row(program, pp, ahead, per_microbatch)
    # The count may ride in DDP's first bucket, which divides the gradients and the loss it
    # carries by it; under cp the loss is summed over cp after the buckets, under ep the
    # experts' gradients are in no bucket, and a loss term of batch statistics
    # (`passes.batch_statistics`) is no sum over targets, so it goes ahead.
    count_may_ride = (program.stages is None and program.plan.zero == 0 and program.plan.cp == 1
                      and program.plan.ep == 1 and not meta.graph_loss(program.graph_module).statistics
                      and carries_loss(program.buckets))
    return ride_agreements(step, count_may_ride=count_may_ride), optimizer


RIDES = (torch.float32, torch.float64)  # dtypes that hold a step number exactly (below 2**24)
# The count of valid targets rides as base-4096 digits: each digit's sum over dp stays below
# 2**24, exact in float32, up to 4096 ranks and 2**36 targets a step.
COUNT_SLOTS, COUNT_RIDES_UP_TO = 2, 4096


def ride_agreements(actions: tuple[StepAction, ...], *, count_may_ride: bool) -> tuple[StepAction, ...]:
    """`actions` with the dp step agreement riding in the first call the step makes on dp
    anyway, where that call is a sum all-reduce of a float32/64 payload: the call grows by the
    agreement's slots and the agreement's own all-reduce goes. Each extra call a step costs a
    sync point with the peers (on gloo about 1.5 ms on two cores), which DDP, which it is
    compared with, does not make.

    That call is the first gradient bucket to launch, and dp's count of valid targets rides
    too (`count_may_ride`: one stage, DDP's buckets, the loss in the last one): the rank's
    graphs are given a count of 1, so their loss is a sum, and the buckets divide the summed
    gradients and loss by the global count once it arrives with the first of them
    (`runtime.state.gradient_buckets`). Elsewhere (bf16, ZeRO's reduce-scatters and gathers, a
    pipeline's count) the agreement keeps its call. tp's and pp's agreements always keep
    theirs: they carry the batch's identity, which must be compared before any call whose
    size depends on the batch (`step_start_actions`). The runtime carries the slots where the
    program says (`runtime.step.numbers`)."""
    axis = Axis.DP
    own = (Purpose.STEP_AGREEMENT, Purpose.VALID_TARGETS)
    i = next((i for i, a in enumerate(actions) if isinstance(a, Communicate) and a.purpose in own
              and a.calls[0].axis == axis.value), None)
    if i is None:
        return actions
    counted = actions[i].purpose is Purpose.VALID_TARGETS
    slots = actions[i].calls[0].numel - (1 if counted else 0)
    for j in range(i + 1, len(actions)):
        later = actions[j]
        k = next((k for k, c in enumerate(later.calls) if c.axis == axis.value), None)
        if isinstance(later, Exchange) or k is None:
            continue
        call = later.calls[k]
        if call.kind != "all_reduce" or call.op != "sum" or call.dtype not in RIDES:
            return actions
        if counted and not (count_may_ride and slots <= COUNT_RIDES_UP_TO and isinstance(later, Communicate)
                            and later.purpose is Purpose.GRADIENT_BUCKET):
            return actions
        count = COUNT_SLOTS if counted else 0
        tag = call.tag + (" + valid targets" if counted else "") + " + step"
        rider = replace(call, numel=call.numel + count + slots, agreement=slots, count=count, tag=tag)
        calls = (*later.calls[:k], rider, *later.calls[k + 1:])
        return (*actions[:i], *actions[i + 1:j], replace(later, calls=calls), *actions[j + 1:])
    return actions


def _batch_dims(program) -> int:
    """The dims of a step's inputs in all (the batch identity's sizes, `step_start_actions`)."""
    return sum(len(shape) for shape in program.captured.example_shapes)


def _single_stage_row(program, per_microbatch: bool) -> tuple[tuple[StepAction, ...], tuple[StepAction, ...]]:
    mesh, gm, zero, buckets = program.mesh, program.graph_module, program.plan.zero, program.buckets
    actions = step_start_actions(mesh, counted=program.loss_reduction.sums,
                                 batch_dims=_batch_dims(program))
    forward, backward = graph_calls(gm, mesh, prefetch=program.plan.gathers_ahead)
    microbatches = program.plan.microbatches
    each = zero == 2 and per_microbatch
    for microbatch in range(microbatches):
        last = microbatch == microbatches - 1
        actions += [Compute("F", 0, microbatch, forward),
                    Compute("B", 0, microbatch,
                            backward_calls(backward, last=last, zero=zero, per_microbatch=per_microbatch))]
        if each:
            actions += bucket_actions(buckets, mesh, zero=zero, carry_loss=False, microbatch=microbatch)
    if zero == 0:  # the loss rides in the last bucket, if that is fp32
        carry = carries_loss(buckets) and mesh.cp == 1  # a sum over cp follows dp's
        actions += bucket_actions(buckets, mesh, zero=0, carry_loss=carry)
        actions += partial_gradient_actions(gm, mesh)
        return tuple(actions + ([] if carry else loss_actions(mesh))), ()
    if not each:
        actions += bucket_actions(buckets, mesh, zero=zero, carry_loss=False)
    actions += partial_gradient_actions(gm, mesh)
    actions += bucket_actions(buckets, mesh, zero=zero, carry_loss=False, held=True)
    actions += loss_actions(mesh)
    return tuple(actions), tuple(optimizer_actions(buckets, mesh, zero=zero))


def _pipeline_row(program, pp: int, ahead: int, per_microbatch: bool
                  ) -> tuple[tuple[StepAction, ...], tuple[StepAction, ...]]:
    """The actions of pipeline rank `pp` (module doc): the step's start, the schedule's row
    (`_scheduled_actions`), the reductions after it (`_pipeline_step_end`); and ZeRO's gathers
    around the optimizer step."""
    mesh, schedule, stages = program.mesh, program.schedule, program.stages
    local = [s for s in stages if schedule.rank_of(s.index) == pp]
    holds_loss = schedule.rank_of(len(stages) - 1) == pp
    actions: list[StepAction] = step_start_actions(mesh, counted=program.loss_reduction.sums and holds_loss,
                                                  batch_dims=_batch_dims(program))
    row = schedule.actions[pp]
    each = program.plan.zero == 2 and per_microbatch  # ZeRO-2's buckets go out per microbatch
    actions += _scheduled_actions(program, local, row, ahead, per_microbatch)
    actions += _pipeline_step_end(program, local, row, pp, each)
    optimizer = [a for stage in local
                 for a in optimizer_actions(stage.buckets, mesh, zero=program.plan.zero, stage=stage.index)]
    return tuple(actions), tuple(optimizer)


def _scheduled_actions(program, local, row, ahead: int, per_microbatch: bool) -> list[StepAction]:
    """The schedule's `row`, each action a `Compute` of its stage's calls (`local`: the rank's
    stages), with an `Exchange` before it: the previous action's sends and the receives due,
    posted `ahead` actions early (`issue_order`), then the buckets the previous action
    completes (`_between_actions`); `per_microbatch` as `lower_row`'s."""
    mesh, stages, zero = program.mesh, program.stages, program.plan.zero
    each = zero == 2 and per_microbatch
    calls = {s.index: graph_calls(s.graph_module, mesh, prefetch=program.plan.gathers_ahead) for s in local}
    last_backward = {s.index: max(i for i, a in enumerate(row) if a.stage == s.index and a.kind == "B")
                     for s in local}
    actions: list[StepAction] = []
    due: list[Receive] = []
    previous = None
    for event, i in issue_order(len(row), ahead):
        action = row[i]
        if event == "receive":
            if expected := _receives(action, stages, mesh):
                due.append(Receive(i, expected))
            continue
        actions += _between_actions(program, row, previous, due, each)
        due, previous = [], i
        forward, backward = calls[action.stage]
        final = i == last_backward[action.stage]
        own = {"F": forward, "W": (),
               "B": backward_calls(backward, last=final, zero=zero, per_microbatch=per_microbatch)}[action.kind]
        actions.append(Compute(action.kind, action.stage, action.microbatch, own))
    return actions + _between_actions(program, row, previous, [], each)


def _between_actions(program, row, previous: int | None, due: list[Receive], each: bool) -> list[StepAction]:
    """What a rank issues after the action at `previous` (None: before its first): one
    `Exchange` of that action's sends and the receives `due`, when there are any, then, with
    ZeRO-2 reducing `each` microbatch, the buckets the action completes (`_microbatch_buckets`)."""
    if previous is None:
        return [Exchange((), tuple(due))] if due else []
    outgoing = _sends(row[previous], program.stages, program.mesh)
    exchange = [Exchange(outgoing, tuple(due))] if outgoing or due else []
    return exchange + (_microbatch_buckets(program, row[previous]) if each else [])


def _receives(action, stages, mesh: Mesh) -> tuple[Call, ...]:
    """What `action` receives before it runs: a forward its stage's inputs from the stage
    before, a backward its outputs' gradients from the stage after."""
    stage, last = stages[action.stage], len(stages) - 1
    if action.kind == "F" and stage.index > 0:
        return _transfers("recv", stage.inputs, mesh, stage.index - 1,
                          f"stage {stage.index} activations", "forward")
    if action.kind == "B" and stage.index < last:
        return _transfers("recv", stage.outputs, mesh, stage.index + 1,
                          f"stage {stage.index} gradients", "backward")
    return ()


def _sends(action, stages, mesh: Mesh) -> tuple[Call, ...]:
    """What `action` sends once it has run: a forward its stage's outputs to the stage after,
    a backward its inputs' gradients to the stage before."""
    stage, last = stages[action.stage], len(stages) - 1
    if action.kind == "F" and stage.index < last:
        return _transfers("send", stage.outputs, mesh, stage.index + 1,
                          f"stage {stage.index + 1} activations", "forward")
    if action.kind == "B" and stage.index > 0:
        return _transfers("send", stage.inputs, mesh, stage.index - 1,
                          f"stage {stage.index - 1} gradients", "backward")
    return ()


def _transfers(kind, boundaries, mesh: Mesh, peer: int, tag: str, phase: str) -> tuple[Call, ...]:
    """One `_transfer` per boundary; backward, only those a gradient flows through."""
    return tuple(_transfer(kind, b, mesh, peer, tag, phase) for b in boundaries
                 if phase == "forward" or b.requires_grad)


def _microbatch_buckets(program, action) -> list[StepAction]:
    """ZeRO-2 reducing per microbatch: the buckets `action` completes (`_completing_kind`), and
    so launches, issued after the Exchange that sends its results on (the peers do not wait
    for them)."""
    stage = program.stages[action.stage]
    if action.kind != _completing_kind(stage):
        return []
    return bucket_actions(stage.buckets, program.mesh, zero=program.plan.zero, stage=stage.index,
                          carry_loss=False, microbatch=action.microbatch)


def _pipeline_step_end(program, local, row, pp: int, each: bool) -> list[StepAction]:
    """What pipeline rank `pp` issues after its row: its stages' buckets in the order they
    complete (unless they went out with `each` microbatch), partial and tied gradients, the buckets ZeRO
    holds for after those sums, and the loss summed over the pipeline and over dp."""
    mesh, zero = program.mesh, program.plan.zero
    actions: list[StepAction] = []
    if not each:
        for stage in sorted(local, key=lambda s: _bucket_completion(s, row)):
            actions += bucket_actions(stage.buckets, mesh, zero=zero, stage=stage.index, carry_loss=False)
    for stage in local:
        actions += partial_gradient_actions(stage.graph_module, mesh, stage=stage.index)
    actions += _tied_gradient_actions(program, pp)
    for stage in local:  # ZeRO: the buckets reduced after those sums
        actions += bucket_actions(stage.buckets, mesh, zero=zero, stage=stage.index, carry_loss=False, held=True)
    actions.append(Communicate(Purpose.PIPELINE_LOSS, (Call(
        kind="all_reduce", numel=1, dtype=torch.float32, axis="pp", tag="pipeline loss", phase="step"),)))
    return actions + loss_actions(mesh)


def _tied_gradient_actions(program, pp: int) -> list[StepAction]:
    """One all-reduce per tied parameter pipeline rank `pp` holds a copy of, summing the
    copies' gradients over the ranks that hold one (`tied_stage_owners`)."""
    actions: list[StepAction] = []
    for name, owners in tied_stage_owners(program).items():
        if any(program.schedule.rank_of(s) == pp for s in owners):
            node = meta.parameter_nodes(program.stages[owners[0]].graph_module.graph)[name]
            numel = local_numel(node.meta["val"].shape, meta.placements(node), program.mesh.sizes)
            call = Call(kind="all_reduce", numel=numel, dtype=node.meta["val"].dtype, tied=name,
                        tag=f"tied {name} gradient", phase="step")
            actions.append(Communicate(Purpose.TIED_GRADIENT, (call,), name=name))
    return actions


def _transfer(kind, boundary: Boundary, mesh: Mesh, peer: int, tag: str, phase: str) -> Call:
    """The call that sends or receives one boundary tensor: this rank's piece of it
    (`placement.local_shape`), the shape the executor allocates and the size the check reads."""
    shape = tuple(sympy.expand(d) for d in local_shape(boundary.shape, boundary.placement, mesh.sizes))
    return Call(kind=kind, numel=sympy.expand(math.prod(shape)), shape=shape, dtype=boundary.dtype, op="none",
                tag=tag, phase=phase, peer_stage=peer)


def _bucket_completion(stage, row) -> int:
    """The position in `row` of the action during which `stage`'s buckets complete, so they
    launch: its last W when it defers weight gradients (zero bubble), else its last B. The
    runtime's hooks launch a rank's buckets in that order across its stages."""
    kind = _completing_kind(stage)
    return max(i for i, a in enumerate(row) if a.stage == stage.index and a.kind == kind)


def _completing_kind(stage) -> str:
    """The action that completes `stage`'s gradients for a microbatch: its W where weight
    gradients are deferred (zero bubble), else its B."""
    return "W" if deferred_weights(stage.graph_module) else "B"


def tied_stage_owners(program) -> dict[str, tuple[int, ...]]:
    """Parameters several pipeline ranks hold -> the stages that read them (sorted by name)."""
    schedule = program.schedule
    owners = shared_parameters(program.stages)
    return {
        name: stages for name, stages in sorted(owners.items())
        if len({schedule.rank_of(s) for s in stages}) > 1
    }


def tied_groups(program) -> dict[int, dict[str, tuple[int, ...]]]:
    """Rank -> tied parameter -> the ranks that keep its copies identical (the same dp, cp and
    tp coordinates, each pipeline rank that holds one of its stages)."""
    mesh, schedule = program.mesh, program.schedule
    groups: dict[int, dict[str, tuple[int, ...]]] = {}
    if program.stages is None:
        return groups
    for name, owners in tied_stage_owners(program).items():
        pp_ranks = sorted({schedule.rank_of(s) for s in owners})
        for dp, cp, tp in itertools.product(range(mesh.dp), range(mesh.cp), range(mesh.tp)):
            group = tuple(mesh.rank_of(dp=dp, pp=pp, tp=tp, cp=cp) for pp in pp_ranks)
            for rank in group:
                groups.setdefault(rank, {})[name] = group
    return groups
