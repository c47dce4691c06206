"""Lowering the reductions: what a rank issues to reduce its gradients and its loss.

`fxpar.compiler.lowering` builds each pipeline row's step program; these are its `Communicate`
actions for the gradients and the loss, by ZeRO stage (Rajbhandari et al. 2020):

    GRADIENT_BUCKET      a bucket's all-reduce (DDP) or reduce-scatter (ZeRO-1/2), once per
                         step or, ZeRO-2 reducing per microbatch, after each backward
    PARTIAL_GRADIENTS    replicated parameters' partial gradients, summed over tp or cp, and
                         experts' over edp
    LOSS                 the step's loss summed over dp, where no bucket carries it, and cp
    UPDATED_PARAMETERS   ZeRO-1/2, around the optimizer step: each bucket's new values gathered

and, for ZeRO-3, which backward holds its layers' reduce-scatters (`backward_calls`). When
ZeRO-2/3 reduce, per microbatch or per step, is `fxpar.plan.zero_reduction`'s decision.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.buckets import Bucket
from fxpar.ir.mesh import Mesh
from fxpar.ir.placement import local_numel
from fxpar.ir.step_program import StepAction, Call, Communicate, Purpose
from fxpar.ops.distributed import BY_NAME

SCATTER_TAG = BY_NAME["gather_parameters"].tag("dp", "backward")  # ZeRO-3's gradients


def bucket_actions(
    buckets: tuple[Bucket, ...], mesh: Mesh, *, zero: int, stage: int = 0, carry_loss: bool = True,
    held: bool = False, microbatch: int | None = None,
) -> list[StepAction]:
    """What one data-parallel rank issues to reduce its gradients, by ZeRO stage (Rajbhandari
    et al. 2020), buckets in launch order (`held`: only the held buckets, else the others):

    * stage 0 (DDP): one all-reduce per gradient bucket. The step's loss rides along as one
      extra element of the last bucket (`carry_loss`), so `runner.step` returns the
      global-batch mean without a call of its own.
    * stages 1 and 2: a reduce-scatter per bucket: each rank keeps the reduced shard of the
      gradients its shard of the optimizer state needs (`optimizer_actions` gathers the
      updated parameters back): 2P moved, like DDP.
    * stage 3: nothing here: each layer's gather and its gradients' reduce-scatter are ops of
      the graph (`passes.zero3`), whose calls each Compute lists.

    Sharded payloads are padded to a multiple of the group size, as reduce-scatter needs
    (`Bucket.padded`). ZeRO-2 reducing per microbatch (`ZeroReduction.per_microbatch`) lists each
    microbatch's reduce-scatters after its backward (`microbatch` names it in the tag).
    """
    n = mesh.dp
    if n == 1:
        return []
    actions: list[StepAction] = []
    mine = [b for b in buckets if b.held == held]

    def add(purpose, kind, numel, dtype, tag, phase, index=0, op="sum") -> None:
        call = Call(kind=kind, numel=numel, dtype=dtype, axis="dp", op=op, tag=tag, phase=phase)
        actions.append(Communicate(purpose, (call,), stage=stage, index=index))

    if zero == 0:
        for b in mine:
            last = b.index == len(buckets) - 1 and carry_loss
            add(Purpose.GRADIENT_BUCKET, "all_reduce", b.numel + (1 if last else 0), b.reduced_dtype,
                f"gradient bucket {b.index}" + (" + loss" if last else ""), "backward", b.index)
        if not buckets and carry_loss:
            actions += loss_actions(mesh, phase="backward")
        return actions
    if zero == 3:
        return actions
    of = f" of microbatch {microbatch}" if microbatch is not None else ""
    for b in mine:
        add(Purpose.GRADIENT_BUCKET, "reduce_scatter", b.padded(n), b.reduced_dtype,
            f"gradient bucket {b.index}{of}", "backward", b.index)
    return actions


def optimizer_actions(buckets: tuple[Bucket, ...], mesh: Mesh, *, zero: int, stage: int = 0) -> list[StepAction]:
    """ZeRO-1/2, after the optimizer stepped its shard: each bucket's updated parameters
    all-gathered over dp into the whole flat bucket."""
    if zero not in (1, 2) or mesh.dp == 1:
        return []
    return [
        Communicate(Purpose.UPDATED_PARAMETERS, (Call(
            kind="all_gather", numel=b.padded(mesh.dp), dtype=b.dtype, axis="dp", op="none",
            tag=f"updated parameters of bucket {b.index}", phase="step"),), stage=stage, index=b.index)
        for b in buckets
    ]


def loss_actions(mesh: Mesh, *, phase: str = "step") -> list[StepAction]:
    """The step's loss summed (dp's divisor first) over dp, where no bucket carries it, then
    over cp, whose ranks each hold the sum over their slice of the sequence."""
    return [
        Communicate(Purpose.LOSS, (Call(kind="all_reduce", numel=1, dtype=torch.float32, axis=axis,
                                        tag="loss" if axis == "dp" else f"{axis} loss", phase=phase),))
        for axis in ("dp", "cp") if mesh.sizes[axis] > 1
    ]


# The axes a parameter's gradient may be a partial sum over, beside dp's buckets: tp's
# replicated parameters, cp's sequence slices, and experts over the ranks holding them.
PARTIAL_AXES = ("tp", "cp", "edp")


def partial_gradient_actions(gm: fx.GraphModule, mesh: Mesh, *, stage: int = 0) -> list[StepAction]:
    """The one all-reduce per step (and stage) and axis that completes replicated parameters'
    partial gradients: over tp (`passes.tensor_parallel.rewrite`,
    settle_parameters_feeding_shards), over cp, where every trained parameter's gradient
    is a sum over each rank's slice of the sequence (`passes.context_parallel`), and an
    expert's over the ranks holding the same experts (`passes.expert_parallel`)."""
    actions = []
    nodes = meta.parameter_nodes(gm.graph)
    for axis in PARTIAL_AXES:
        names = meta.partial_gradient_parameters(gm.graph, axis)
        if mesh.sizes[axis] == 1 or not names:
            continue
        numel = sum(local_numel(nodes[n].meta["val"].shape, meta.placements(nodes[n]), mesh.sizes) for n in names)
        call = Call(kind="all_reduce", numel=numel, dtype=nodes[names[0]].meta["val"].dtype, axis=axis,
                    tag=f"{axis} partial parameter gradients", phase="step")
        actions.append(Communicate(Purpose.PARTIAL_GRADIENTS, (call,), stage=stage))
    return actions


def backward_calls(calls: tuple[Call, ...], *, last: bool, zero: int, per_microbatch: bool) -> tuple[Call, ...]:
    """One microbatch's backward calls of a stage: under ZeRO-3 reducing once per step (not
    `per_microbatch`), the layers' reduce-scatters only in the stage's last backward of the
    step (the earlier ones accumulate the whole gradients: `runtime.state.parameter_gatherer`)."""
    if last or zero != 3 or per_microbatch:
        return calls
    return tuple(c for c in calls if c.tag != SCATTER_TAG)
