"""`program.estimate()`: FLOPs, memory, bytes moved and time of one step, per rank, as formulas.

Every number comes with the sympy formula behind it, in the symbols `batch` (global batch, in
sequences) and `seq`; plan degrees and hardware constants are already numbers in it. The
pieces, each in its own module:

    compute     cost.ops            FLOPs and bytes per aten op, summed over the captured graph
    activations cost.activations    bytes autograd saves, from a symbolic fake forward
    model state cost.memory         params, grads, optimizer state by precision and ZeRO stage
    comm        fxpar.collectives   the collectives each rank issues (the runtime's own list)
                cost.collectives    ring wire bytes and alpha-beta time per collective

Time model: matmul FLOPs at the device's matmul rate plus the other ops' bytes at memory
bandwidth, backward = 2x forward; the optimizer step is memory-bound; collectives of the
forward (backward) phase overlap forward (backward) compute, so what is exposed is the larger
of the last call and the part that outlasts the compute; collectives around the optimizer
step are fully exposed. No pipeline yet, so no bubble.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy

from fxpar.cost.activations import saved_activation_bytes
from fxpar.cost.collectives import collective_time, wire_bytes
from fxpar.cost.hardware import Hardware, hardware_profile
from fxpar.cost.memory import model_state_bytes
from fxpar.cost.ops import cost_of
from fxpar.cost.symbols import BATCH

if TYPE_CHECKING:
    from fxpar.program import Program

# Bytes the optimizer step reads and writes per parameter it updates (fp32 state).
_OPTIMIZER_TRAFFIC = {"adamw": 28, "adam": 28, "sgd-momentum": 20, "sgd": 12}


@dataclass(frozen=True)
class GraphCompute:
    """Forward cost of the whole captured graph over the global batch."""

    matmul_flops: sympy.Expr
    other_flops: sympy.Expr
    other_bytes: sympy.Expr  # bytes moved by non-matmul ops
    uncosted: dict[str, int]


def graph_compute(program: Program) -> GraphCompute:
    """Sum the per-op rules over the captured graph (cached on the program)."""
    cached = getattr(program, "_graph_compute", None)
    if cached is not None:
        return cached
    captured = program.captured
    matmul = other = moved = sympy.Integer(0)
    uncosted: dict[str, int] = {}
    for node in captured.graph_module.graph.nodes:
        cost = cost_of(node, captured.shape)
        if cost is None:
            continue
        matmul += cost.matmul_flops
        other += cost.other_flops
        if cost.matmul_flops == 0:
            moved += cost.bytes
        if not cost.costed:
            uncosted[str(node.target)] = uncosted.get(str(node.target), 0) + 1
    result = GraphCompute(sympy.expand(matmul), sympy.expand(other), sympy.expand(moved), uncosted)
    program._graph_compute = result
    return result


def _activations(program: Program) -> sympy.Expr:
    cached = getattr(program, "_activation_bytes", None)
    if cached is None:
        cached = program._activation_bytes = saved_activation_bytes(program.captured)
    return cached


@dataclass(frozen=True)
class Estimate:
    """One step of a compiled program, predicted. Bytes are bytes, times seconds."""

    plan: str
    hardware: str
    optimizer: str
    sizes: dict[str, int]  # the batch and seq the numbers are evaluated at
    rank: int  # the worst rank, whose memory and time are shown
    params: int  # trainable parameters, tied weights once
    flops: dict[str, float]  # whole step, all ranks: matmul, other, total
    memory: dict[str, float]  # on the worst rank: params, grads, optimizer, activations, total
    comm: dict[str, dict[str, float]]  # per kind, on the worst rank: count, payload/wire bytes
    time: dict[str, float]  # compute, optimizer, comm_exposed, bubble, total
    formulas: dict[str, sympy.Expr]  # "flops.total" -> expression in batch and seq
    uncosted: dict[str, int]  # ops without a compute rule -> occurrences
    peak_flops: float  # of one device, in the plan's math precision (for MFU)
    world_size: int

    def mfu(self, seconds: float | None = None) -> float:
        """Model FLOPs utilisation of a step taking `seconds` (default: the predicted time)."""
        return mfu(self.flops["matmul"], seconds or self.time["total"], self.world_size, self.peak_flops)

    def table(self) -> str:
        """A readable report: each number with the formula behind it."""
        sizes = " ".join(f"{k}={v}" for k, v in self.sizes.items())
        lines = [
            f"fxpar estimate: plan '{self.plan}' on {self.hardware}, {self.optimizer}, {sizes}, "
            f"rank {self.rank} of {self.world_size}",
            f"  parameters            {self.params:,}",
        ]
        for group, unit in (("flops", "FLOP"), ("memory", "B"), ("time", "s")):
            values = getattr(self, group)
            for key, value in values.items():
                formula = self.formulas.get(f"{group}.{key}")
                shown = "" if formula is None or formula.is_number else f"   = {_short(formula)}"
                lines.append(f"  {group + '.' + key:<22}{_si(value, unit):>12}{shown}")
        for kind, entry in self.comm.items():
            lines.append(
                f"  comm.{kind:<17}{entry['count']:>6.0f} calls, payload "
                f"{_si(entry['payload_bytes'], 'B')}, wire {_si(entry['wire_bytes'], 'B')}"
            )
        if not self.comm:
            lines.append("  comm                  none")
        lines.append(f"  MFU at predicted time {100 * self.mfu():.1f}%")
        uncosted = ", ".join(f"{op} x{n}" for op, n in self.uncosted.items()) or "none"
        lines.append(f"  uncosted ops          {uncosted}")
        return "\n".join(lines)


def mfu(flops: float, seconds: float, n_devices: int, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' peak (PaLM appendix B).

    `flops` are model FLOPs of one step under fxpar's convention (matmul FLOPs, backward = 2x
    forward, attention without causal discount), so figures compare with Megatron's.
    """
    return flops / (seconds * n_devices * peak)


def estimate(
    program: Program,
    *,
    hardware: str | Hardware = "h100",
    optimizer: str = "adamw",
    batch: int | None = None,
    seq: int | None = None,
) -> Estimate:
    """Predict one training step of `program` (see module doc)."""
    device = hardware if isinstance(hardware, Hardware) else hardware_profile(hardware)
    plan, captured = program.plan, program.captured
    sizes = {s.name: v for s, v in captured.example_sizes.items()}
    sizes.update({k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None})
    numbers = {s: sizes[s.name] for s in captured.example_sizes}

    precision = "bf16" if plan.precision == "bf16-mixed" else "fp32"
    narrow = sympy.Rational(1, 2) if plan.precision == "bf16-mixed" else 1  # bf16 tensors
    dp, share = plan.dp, sympy.Rational(1, plan.dp)
    compute = graph_compute(program)
    formulas: dict[str, sympy.Expr] = {}

    # FLOPs of the whole step; each data-parallel rank does 1/dp of them.
    formulas["flops.matmul"] = 3 * compute.matmul_flops
    formulas["flops.other"] = 3 * compute.other_flops
    formulas["flops.total"] = formulas["flops.matmul"] + formulas["flops.other"]

    # Memory of one rank: model state plus one microbatch's saved activations.
    params = captured.parameter_count()
    state = model_state_bytes(params, precision=plan.precision, optimizer=optimizer,
                              zero=plan.zero, dp=dp)
    local_batch = BATCH / (dp * plan.microbatches)
    formulas.update({f"memory.{k}": v for k, v in state.items()})
    formulas["memory.activations"] = narrow * _activations(program).subs(BATCH, local_batch)
    formulas["memory.total"] = sum(formulas[f"memory.{k}"] for k in (*state, "activations"))

    # Time of one rank.
    rate, bandwidth = device.matmul_rate(precision), device.memory_bandwidth
    forward = (share * compute.matmul_flops / rate) + (share * narrow * compute.other_bytes / bandwidth)
    formulas["time.compute"] = 3 * forward
    updated = params * (share if plan.zero >= 1 else 1)
    formulas["time.optimizer"] = sympy.sympify(_OPTIMIZER_TRAFFIC[optimizer] * updated / bandwidth)

    rank = 0
    comm: dict[str, dict[str, float]] = {}
    phase_calls: dict[str, list[sympy.Expr]] = {"forward": [], "backward": [], "step": []}
    for call in program.collectives(rank):
        scale = narrow if call.numel > 1 else 1  # gradients and parameters travel in bf16
        payload = call.payload_bytes * scale
        n = len(call.group)
        entry = comm.setdefault(call.kind, {"count": 0, "payload_bytes": 0, "wire_bytes": 0})
        entry["count"] += 1
        entry["payload_bytes"] += float(payload)
        entry["wire_bytes"] += float(wire_bytes(call.kind, payload, n))
        phase_calls[call.phase].append(collective_time(call.kind, payload, n, device.link(call.group)))
    exposed = sum(phase_calls["step"], sympy.Integer(0))
    for phase, overlapped in (("forward", forward), ("backward", 2 * forward)):
        if phase_calls[phase]:
            total = sum(phase_calls[phase])
            exposed += sympy.Max(phase_calls[phase][-1], total - overlapped)
    formulas["time.comm_exposed"] = exposed
    formulas["time.bubble"] = sympy.Integer(0)
    formulas["time.total"] = sum(
        formulas[f"time.{k}"] for k in ("compute", "optimizer", "comm_exposed", "bubble")
    )

    values = {k: float(v.subs(numbers)) for k, v in formulas.items()}
    pick = lambda group, keys: {k: values[f"{group}.{k}"] for k in keys}  # noqa: E731
    return Estimate(
        plan=str(plan),
        hardware=device.name,
        optimizer=optimizer,
        sizes=sizes,
        rank=rank,
        params=params,
        flops=pick("flops", ("matmul", "other", "total")),
        memory=pick("memory", ("params", "grads", "optimizer", "activations", "total")),
        comm=comm,
        time=pick("time", ("compute", "optimizer", "comm_exposed", "bubble", "total")),
        formulas={k: sympy.nsimplify(v) if v.is_number else _rounded(v) for k, v in formulas.items()},
        uncosted=compute.uncosted,
        peak_flops=device.peak_flops[precision],
        world_size=program.world_size,
    )


def _rounded(expr: sympy.Expr) -> sympy.Expr:
    """Floats in a formula shown to 4 significant digits; integers kept exact."""
    return expr.xreplace({f: sympy.Float(f, 4) for f in expr.atoms(sympy.Float)})


def _short(expr: sympy.Expr) -> str:
    text = str(expr)
    return text if len(text) <= 90 else text[:87] + "..."


_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _si(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.3f} s"
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.3f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


