"""A rank's step time, piece by piece: the compute of each share of the work, and the
communication the step leaves exposed. The rules are `cost.estimate`'s (its module doc, "Time
model"); they live here so that the estimate and `estimate.exposed_comm_seconds`, which
prices ZeRO's two ways of reducing (`fxpar.plan.zero_reduction`), read one implementation.
"""

from __future__ import annotations

import sympy

from fxpar.cost.collectives import collective_time, wire_bytes
from fxpar.cost.compiled_graphs import PartitionedGraphs, graph_kernels
from fxpar.cost.fused_kernels import Kernel
from fxpar.cost.hardware import Hardware
from fxpar.ir.step_program import Call, Compute, StepProgram
from fxpar.ir.symbols import BATCH


def piece_seconds(piece, plan, device: Hardware, precision: str):
    """Forward, backward, weight-gradient and recompute seconds of one share of the work
    (`cost.layout`) over this rank's share of the batch; `weight` is the part of `backward`
    that is weight gradients of linears (W in a split schedule). Bytes are in the dtypes the
    rank's graph computes in (`cost.layout`: bf16-mixed's bf16 ops, its fp32 loss and casts).
    Each dense matmul is priced at its own shape on one microbatch (`dense_seconds`), its
    backward as its two gradients' matmuls; attention and the other ops' bytes by
    `Hardware.kernel_seconds`, the backward twice the forward."""
    share = sympy.Rational(1, plan.dp)
    kernels = share * device.kernel_seconds(piece.attention_flops, piece.bytes_by_kind, precision)

    def dense(shapes):
        return dense_seconds(shapes, plan, device, precision)

    overhead = plan.microbatches * sympy.Float(device.op_overhead)
    together = sympy.Max if device.host_overlap else sympy.Add  # (`Hardware.host_overlap`)
    forward = together(kernels + dense(piece.dense_shapes), piece.forward_ops * overhead)
    backward = together(2 * kernels + dense(piece.backward_shapes), piece.backward_nodes * overhead)
    weight = dense(piece.weight_gradient_shapes)
    recompute = together(
        share * device.kernel_seconds(piece.recompute_attention_flops, piece.recompute_bytes_by_kind, precision)
        + dense(piece.recompute_shapes),
        piece.recompute_ops * overhead)
    return forward, backward, weight, recompute


def compiled_piece_seconds(piece, graphs: PartitionedGraphs, readable, plan, device: Hardware, precision: str,
                           calls: tuple[int, int] = (1, 0)):
    """`piece_seconds` under `compile=inductor`: forward, backward, weight-gradient and
    recompute seconds of one share of the work (`cost.layout`), from the kernels Inductor runs
    for its compiled module (its partitioned `graphs`, sizes read through `readable`, the
    capture's symbols; `cost.fused_kernels`): each dense matmul at its shape, attention at the
    attention rate, fused kernels' bytes at `Hardware.fused_seconds`, an op Inductor cannot
    generate at the copy bandwidth, and `kernel_launch` per kernel. Each forward and backward
    also pays its host calls (`cost.compiled_pieces.compiled_calls`: compiled graphs at
    `compiled_call`, ops run op by op at `op_overhead`). The recomputation of checkpoint
    regions is part of the compiled backward: its kernels (those whose every op a region tags)
    are `recompute`, the rest `backward`. `weight` is the part of `backward` that a split
    schedule runs as W: the deferred linears' weight-gradient matmuls, which run op by op
    between the compiled pieces, priced as in eager mode."""
    forward, backward = graph_kernels(graphs, readable)
    graphs_called, ops = calls
    host = plan.microbatches * (graphs_called * sympy.Float(device.compiled_call) + ops * sympy.Float(device.op_overhead))
    return (_kernel_seconds(forward, plan, device, precision, host),
            _kernel_seconds([k for k in backward if not k.recomputed], plan, device, precision, host),
            dense_seconds(piece.weight_gradient_shapes, plan, device, precision),
            _kernel_seconds([k for k in backward if k.recomputed], plan, device, precision))


def _kernel_seconds(found: list[Kernel], plan, device: Hardware, precision: str, host=sympy.Integer(0)):
    """Seconds of `found`, kernels of one compiled graph, per step on one rank: each
    microbatch runs them all over its share of the batch; `host`: the calls around them."""
    shapes: dict[tuple, int] = {}
    for kernel in found:
        if kernel.kind == "dense":
            shapes[kernel.shape] = shapes.get(kernel.shape, 0) + 1
    attention = sum((k.attention_flops for k in found), sympy.Integer(0))
    fused = sum((k.bytes for k in found if k.kind == "fused"), sympy.Integer(0))
    extern = sum((k.bytes for k in found if k.kind == "extern"), sympy.Integer(0))
    streamed = (attention / device.attention_rate(precision) + device.fused_seconds(fused)
                + extern / device.elementwise_bandwidth("copy")) / plan.dp
    launches = len(found) * plan.microbatches * sympy.Float(device.kernel_launch) + host
    together = sympy.Max if device.host_overlap else sympy.Add  # (`Hardware.host_overlap`)
    return together(streamed + dense_seconds(shapes, plan, device, precision), launches)


def dense_seconds(shapes, plan, device: Hardware, precision: str):
    """Seconds of a step's dense matmuls on one rank: each (m, k, n) of `shapes` (over the
    global batch, `cost.layout.Share`) run once per microbatch at the shape it has there (the
    batch divided by dp x microbatches), at that shape's rate (`Hardware.matmul_seconds`)."""
    local = {BATCH: BATCH / (plan.dp * plan.microbatches)}
    return sum((count * plan.microbatches * device.matmul_seconds(*(sympy.sympify(d).subs(local) for d in shape),
                                                                  precision)
                for shape, count in shapes.items()), sympy.Integer(0))


def comm_terms(program, step: StepProgram, device: Hardware, forward, backward):
    """The exposed communication seconds of a rank's `step` (a formula, given its forward and
    backward seconds) and its table of calls per kind (`cost.estimate`'s module doc, "comm")."""
    comm: dict[str, dict[str, float]] = {}
    # Backward calls hide under the backward they are issued in or after (`backward_windows`).
    windows, backwards = backward_windows(step)
    phase_calls: dict[tuple[str, int], list[sympy.Expr]] = {}
    exposed = sympy.Integer(0)
    for planned, call, window in zip(step.calls(), step.collectives(program.example_sizes), windows, strict=True):
        payload = call.payload_bytes  # in the dtype the call moves (bf16 where bf16 travels)
        n = len(call.group)
        entry = comm.setdefault(call.kind, {"count": 0, "payload_bytes": 0, "wire_bytes": 0})
        entry["count"] += 1
        entry["payload_bytes"] += float(payload)
        entry["wire_bytes"] += float(wire_bytes(call.kind, payload, n))
        seconds = collective_time(call.kind, payload, n, device.link(call.group))
        if waits_where_issued(planned, program.plan):
            exposed += seconds
            continue
        key = (call.phase, window if call.phase == "backward" else 0)
        phase_calls.setdefault(key, []).append(seconds)
    for (phase, _), times in phase_calls.items():
        window = {"forward": forward, "backward": backward / backwards, "step": 0}[phase]
        if device.comm_overlap == 0 or phase == "step":
            exposed += sum(times)
        else:
            exposed += sympy.Max(times[-1], sum(times) - device.comm_overlap * window)
    return exposed, comm


def waits_where_issued(call: Call, plan) -> bool:
    """Whether the compute after `call` waits for it where it is issued, so no compute hides
    it: a tensor-parallel op's call, whose result the next op reads (Megatron's f and g,
    sequence parallelism's gathers and reduce-scatters: Narayanan et al. 2021 Sec. 3.3; the
    eager runtime runs each as a call and its wait), context parallelism's key and value
    gathers, which attention reads next, and the step agreements on those groups.
    Under `compile=inductor` a backward one is waited for after the work that does not need
    it (`runtime.collective_schedule`: f's input gradient is all-reduced while the weight
    gradients are computed), so it may hide as the backward's other calls do."""
    return call.axis in ("tp", "cp") and not (plan.compile == "inductor" and call.phase == "backward")


def backward_windows(step: StepProgram) -> tuple[list[int], int]:
    """For each call of `step` (in `StepProgram.calls()` order), the backward compute it can
    hide under: the last B (or W) action at or before it, counted from 0; and how many there
    are. A microbatch's calls hide under its own backward, so gradients reduced once per step
    hide only under the last one, and those reduced per microbatch each under theirs
    (`fxpar.plan.zero_reduction`)."""
    windows, seen = [], 0
    for action in (*step.actions, *step.optimizer):
        if isinstance(action, Compute) and action.kind in ("B", "W"):
            seen += 1
        windows += [max(seen - 1, 0)] * len(action.calls)
    return windows, max(seen, 1)
