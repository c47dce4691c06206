"""Collectives as data: what each rank will issue in one training step, known at compile time.

The compiler lists, per rank, every collective of a step in issue order. Two uses:

* `check_collectives` proves before any rank runs that on every process group all members
  issue the same sequence (kind, payload, dtype, reduce op): the mismatches that make NCCL
  hang (DESIGN.md decision 7);
* the runtime records what it really issued in the same form (`Runner.comm_log()`), so a test
  can assert that prediction and reality agree call for call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from fxpar import meta
from fxpar.distributed_ops import COMMUNICATING, axis_of, distributed_op
from fxpar.errors import PlanError
from fxpar.passes.data_parallel import Bucket
from fxpar.placement import local_numel

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"]
# When in the step a collective runs; the cost model overlaps forward and backward ones with
# compute and counts "step" ones (around the optimizer step) as exposed.
Phase = Literal["forward", "backward", "step"]


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective call of one rank: its group, payload and purpose."""

    kind: CollectiveKind
    group: tuple[int, ...]  # global ranks of the process group, sorted
    numel: int  # payload elements (all_reduce: its tensor; all_gather: its output; ...)
    dtype: torch.dtype
    op: Literal["sum", "max", "none"] = "sum"
    tag: str = ""  # what it is for, e.g. "gradient bucket 0"; not part of the match
    phase: Phase = "backward"  # not part of the match either

    @property
    def payload_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def signature(self) -> tuple:
        """What all members of the group must agree on."""
        return (self.kind, self.group, self.numel, self.dtype, self.op)

    def __str__(self) -> str:
        return (
            f"{self.kind}({self.numel} x {self.dtype}, op={self.op}) on ranks "
            f"{list(self.group)} [{self.tag}]"
        )


def check_collectives(
    world_size: int, collectives_of: Callable[[int], Iterable[Collective]]
) -> None:
    """Raise PlanError unless every group's members issue identical collective sequences."""
    per_group: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for rank in range(world_size):
        for call in collectives_of(rank):
            if call.kind in ("send", "recv"):
                continue  # point to point: matched pair by pair (pipeline_program.check_pipeline)
            if rank not in call.group:
                raise PlanError(f"rank {rank} issues a collective on a group without it: {call}")
            per_group.setdefault(call.group, {}).setdefault(rank, []).append(call)
    for group, by_rank in per_group.items():
        reference_rank = group[0]
        reference = by_rank.get(reference_rank, [])
        for rank in group[1:]:
            calls = by_rank.get(rank, [])
            for i in range(max(len(reference), len(calls))):
                a = reference[i] if i < len(reference) else None
                b = calls[i] if i < len(calls) else None
                if a is None or b is None or a.signature() != b.signature():
                    raise PlanError(
                        f"collective #{i} on process group {list(group)} does not match: rank "
                        f"{reference_rank} issues {a or 'nothing'}, rank {rank} issues "
                        f"{b or 'nothing'}; the job would hang. This is an fxpar bug for a "
                        "plan it accepted: please report it with the plan and model"
                    )


def data_parallel_collectives(
    buckets: tuple[Bucket, ...], group: tuple[int, ...], *, zero: int, carry_loss: bool = True
) -> tuple[Collective, ...]:
    """What one data-parallel rank issues per step, by ZeRO stage (Rajbhandari et al. 2020).

    * stage 0 (DDP): one all-reduce per gradient bucket, in bucket order, after the last
      microbatch's backward. The step's loss rides along as one extra element of the last
      bucket, so `runner.step` returns the global-batch mean without a call of its own.
    * stages 1 and 2: a reduce-scatter per bucket in backward (each rank keeps the gradient
      shard its optimizer-state shard needs), the loss all-reduce, then an all-gather per
      bucket of the updated parameters after the optimizer step: 2P moved, like DDP.
    * stage 3: parameters live sharded, so each bucket is all-gathered before its first use
      in forward (the last bucket first) and again in backward, then its gradients are
      reduce-scattered: 3P moved (ZeRO Sec. 7).

    Sharded payloads are padded to a multiple of the group size, as reduce-scatter needs.
    """
    n = len(group)
    if n == 1:
        return ()
    calls: list[Collective] = []

    def call(kind, numel, dtype, tag, phase) -> None:
        calls.append(Collective(kind=kind, group=group, numel=numel, dtype=dtype, tag=tag, phase=phase))

    padded = {b.index: -(-b.numel // n) * n for b in buckets}
    loss_dtype = buckets[-1].dtype if buckets else torch.float32
    if zero == 0:
        for b in buckets:
            last = b.index == len(buckets) - 1 and carry_loss
            numel = b.numel + (1 if last else 0)
            call("all_reduce", numel, b.dtype, f"gradient bucket {b.index}" + (" + loss" if last else ""), "backward")
        if not buckets and carry_loss:
            call("all_reduce", 1, loss_dtype, "loss", "backward")
        return tuple(calls)
    if zero == 3:
        for b in reversed(buckets):
            call("all_gather", padded[b.index], b.dtype, f"parameters of bucket {b.index}", "forward")
    for b in buckets:
        if zero == 3:
            call("all_gather", padded[b.index], b.dtype, f"parameters of bucket {b.index}", "backward")
        call("reduce_scatter", padded[b.index], b.dtype, f"gradient bucket {b.index}", "backward")
    if carry_loss:
        call("all_reduce", 1, loss_dtype, "loss", "backward")
    if zero in (1, 2):
        for b in buckets:
            call("all_gather", padded[b.index], b.dtype, f"updated parameters of bucket {b.index}", "step")
    return tuple(calls)


def valid_target_collectives(group: tuple[int, ...], *, counted: bool) -> tuple[Collective, ...]:
    """The step's count of valid targets summed over the data-parallel group, before the first
    forward: one scalar all-reduce when the loss is a sum over that count
    (`passes.loss_normalisation`), issued by the ranks that compute the loss."""
    if not counted or len(group) == 1:
        return ()
    return (Collective(kind="all_reduce", group=group, numel=1, dtype=torch.int64,
                       tag="valid targets", phase="forward"),)


def tensor_parallel_collectives(
    gm: fx.GraphModule, group_of: Callable[[str], tuple[int, ...]], sizes: dict
) -> tuple[Collective, ...]:
    """One microbatch's collectives of the graph's distributed ops: forward in graph order,
    then backward, read off each op's own description (`fxpar.distributed_ops`).

    `group_of` maps a mesh axis name to this rank's group on it; `sizes` gives export's size
    symbols their values in one microbatch. Backward collectives are listed in reverse graph
    order, the order autograd runs them in, and only where a gradient flows. Payloads: an
    all-reduce's and a reduce-scatter's input, an all-gather's output, each this rank's piece
    (`placement.local_numel`); backward swaps input and output.
    """
    forward: list[Collective] = []
    backward: list[Collective] = []
    for node in gm.graph.nodes:
        op = distributed_op(node)
        if op is None:
            continue
        axis = axis_of(node)
        group = group_of(axis)
        if len(group) == 1:
            continue
        source = node.args[0]
        ends = {"in": _local_numel(source, sizes, len(group)), "out": _local_numel(node, sizes, len(group))}
        dtype = source.meta["val"].dtype
        for phase, calls, (payload_in, payload_out) in (
            ("forward", forward, ("in", "out")),
            ("backward", backward, ("out", "in")),
        ):
            primitive = op.primitive(phase)
            if primitive not in COMMUNICATING or (phase == "backward" and not meta.requires_grad(source)):
                continue
            numel = ends[payload_out] if primitive == "all_gather" else ends[payload_in]
            reduce = "none" if primitive == "all_gather" else op.reduce
            calls.append(Collective(kind=primitive, group=group, numel=numel, dtype=dtype, op=reduce,
                                    tag=op.tag(axis, phase), phase=phase))
    return tuple(forward + backward[::-1])


def partial_gradient_collectives(gm: fx.GraphModule, group: tuple[int, ...]) -> tuple[Collective, ...]:
    """The one all-reduce per step that completes replicated parameters' partial gradients."""
    names = meta.partial_gradient_parameters(gm.graph)
    if len(group) == 1 or not names:
        return ()
    nodes = meta.parameter_nodes(gm.graph)
    numel = sum(nodes[n].meta["val"].numel() for n in names)
    dtype = nodes[names[0]].meta["val"].dtype
    return (Collective(kind="all_reduce", group=group, numel=numel, dtype=dtype,
                       tag="tp partial parameter gradients", phase="step"),)


def _local_numel(node: fx.Node, sizes: dict, size: int) -> int:
    """Elements of this rank's piece of `node`'s value at the microbatch's sizes."""
    shape = [int(d.node.expr.subs(sizes)) if isinstance(d, torch.SymInt) else int(d) for d in node.meta["val"].shape]
    return local_numel(shape, meta.placement(node), size)
