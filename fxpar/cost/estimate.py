"""`program.estimate()`: FLOPs, memory, bytes moved and time of one step, per rank, as formulas.

Every number comes with the sympy formula behind it, in the symbols `batch` (global batch, in
sequences) and `seq`; plan degrees and hardware constants are already numbers in it. The
pieces, each in its own module:

    compute     cost.ops            FLOPs, bytes and op counts per aten op, over the captured graph
    activations cost.activations    bytes autograd saves (symbolic fake forward)
    workspace   cost.workspace      what backward allocates beside them: the loss's, one op's, transfers
    model state cost.memory         params, grads, optimizer state by precision and ZeRO stage;
                                    the step's peak
    comm        fxpar.ir.collectives   the collectives each rank issues (the runtime's own list)
                cost.collectives    ring wire bytes and alpha-beta time per collective
    time        cost.step_time      compute per share of the work, communication exposed
    constants   cost.hardware       rates, bandwidths, overheads (cost.calibrate measures the CPU)

Memory: `total` is the step's predicted PEAK on the worst rank (`cost.memory.peak_bytes`), not
the sum of the terms above it. The optimizer term is the ZeRO paper's bytes per parameter
plus Adam's `step` counters, 4 bytes per tensor the rank updates (`cost.optimizer`), a term
of its own below so that `model_state_bytes` stays the paper's formula.

Time model, per rank:

* recompute: under activation checkpointing, the recomputed nodes' forward once more
  (`fxpar.ir.recompute_regions`: every block for `full`, attention's core for `selective`),
  priced like the forward, in backward (a pipeline's B);
* compute: non-attention matmul FLOPs at the matmul rate, attention FLOPs at the attention
  rate, the other ops' bytes at the bandwidth they reach (`elementwise_efficiency` x memory
  bandwidth), backward = 2x forward for all three
  (Narayanan et al. 2021); plus `op_overhead` per forward op and per backward node
  (`cost.ops.op_counts`), per microbatch;
* optimizer: a cost per parameter tensor the rank updates plus the bytes the step moves at
  memory bandwidth (`cost.optimizer`);
* comm: collectives of the forward phase may hide under `comm_overlap` x the forward's
  compute, and those of the backward phase under that share of the backward they are issued
  in or after (one microbatch's, `cost.step_time.backward_windows`: gradients reduced once
  per step hide under the last backward only, those reduced per microbatch each under
  theirs), so what is exposed is, per window, the larger of its last call and the part that
  outlasts the hidden share (all of it when `comm_overlap` is 0, as on the CPU); collectives
  around the optimizer step are fully exposed, and so are tensor parallelism's: the op after
  Megatron's f or g (or sequence parallelism's gather or reduce-scatter) reads what the call
  returns, so the runtime waits for it where it is issued (Narayanan et al. 2021 Sec. 3.3),
  except a backward one under `compile=inductor`, waited for after the weight gradients that
  do not need it (`runtime.collective_schedule`; `cost.step_time.waits_where_issued`);
* bubble: with a pipeline, the schedule simulated with each stage's predicted times and one
  boundary transfer between dependent actions on different ranks (`fxpar.schedule.simulation.simulate`);
  the rank's idle time in it (the simulation itself is `Estimate.pipeline`). A schedule that
  splits the backward (zb-h1) runs each stage's backward as B and W: W is the weight
  gradients of the stage's linears, each its forward matmul FLOPs at the matmul rate (half
  the linear's backward; `cost.layout`), B the rest of the backward.

CPU ranks of one machine share its cores: where the profile knows them (the measured `cpu`
profile), compute and optimizer are priced at the rate each rank gets when all compute at
once (`Hardware.shared_by`: four 1-thread ranks on two cores run at half speed).

Per rank: tensor parallelism divides the work of sharded ops and the parameters it splits,
a pipeline gives each rank its stages (`cost.layout`). Its activations are the bytes its own
modules save for backward (`cost.activations.rank_activation_bytes`, a fake forward of what
the rank runs, activation checkpointing included) for one microbatch, times the microbatches
it keeps in flight under the schedule. The worst rank by peak memory is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from fxpar.cost.activations import rank_activation_bytes, recomputed_nodes, saved_in_flight
from fxpar.cost.collectives import collective_time
from fxpar.cost.hardware import Hardware
from fxpar.cost.layout import shares
from fxpar.cost.memo import memoised
from fxpar.cost.memory import model_state_bytes, peak_bytes
from fxpar.cost.ops import cost_of, exact_draws, op_counts
from fxpar.cost.optimizer import STEP_COUNTER_BYTES, optimizer_seconds
from fxpar.cost.profiles import hardware_profile
from fxpar.cost.compiled_graphs import graph_kernels, module_graphs, stage_graphs, stage_module
from fxpar.cost.compiled_pieces import compiled_calls
from fxpar.cost.step_time import comm_terms, compiled_piece_seconds, piece_seconds
from fxpar.cost.workspace import backward_bytes, gathered_bytes, loss_workspace_bytes, transfer_bytes
from fxpar.ir import meta
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.step_program import StepProgram
from fxpar.ir.symbols import BATCH
from fxpar.schedule.simulation import Simulation, simulate



@dataclass(frozen=True)
class GraphCompute:
    """Forward cost of the whole captured graph over the global batch."""

    matmul_flops: sympy.Expr  # attention included
    attention_flops: sympy.Expr  # the attention part of matmul_flops
    other_flops: sympy.Expr
    other_bytes: sympy.Expr  # bytes moved by non-matmul ops
    uncosted: dict[str, int]
    forward_ops: int  # aten calls of one forward (`cost.ops.op_counts`)
    backward_nodes: int  # nodes of its backward graph


def graph_compute(program: CompiledProgram) -> GraphCompute:
    """Sum the per-op rules over the captured graph (memoised with it: `cost.memo`)."""
    captured = program.captured
    return memoised(captured.graph_module, "graph_compute", lambda: _sum_rules(captured))


def _sum_rules(captured) -> GraphCompute:
    matmul = attention = other = moved = sympy.Integer(0)
    uncosted: dict[str, int] = {}
    for node in captured.graph_module.graph.nodes:
        cost = cost_of(node, captured.shape)
        if cost is None:
            continue
        matmul += cost.matmul_flops
        attention += cost.attention_flops
        other += cost.other_flops
        if cost.matmul_flops == 0:
            moved += cost.bytes
        if not cost.costed:
            uncosted[str(node.target)] = uncosted.get(str(node.target), 0) + 1
    forward_ops, backward_nodes = op_counts(captured.graph_module)
    return GraphCompute(
        sympy.expand(matmul), sympy.expand(attention), sympy.expand(other), sympy.expand(moved),
        uncosted, forward_ops, backward_nodes,
    )


def recompute_flops(program: CompiledProgram) -> sympy.Expr:
    """FLOPs activation checkpointing adds to the step, all ranks: one more forward of the
    recomputed nodes (`cost.activations.recomputed_nodes`) over the global batch."""
    captured, checkpoint = program.captured, program.plan.checkpoint

    def total() -> sympy.Expr:
        flops = sympy.Integer(0)
        for node in recomputed_nodes(captured, checkpoint):
            if (cost := cost_of(node, captured.shape)) is not None:
                flops += cost.matmul_flops + cost.other_flops
        return sympy.expand(flops)

    return memoised(captured.graph_module, f"recompute_flops.{checkpoint}", total)


@dataclass(frozen=True)
class Estimate:
    """One step of a compiled program, predicted. Bytes are bytes, times seconds."""

    plan: str
    hardware: str
    optimizer: str
    sizes: dict[str, int]  # the batch and seq the numbers are evaluated at
    rank: int  # the worst rank, whose memory and time are shown
    params: int  # trainable parameters, tied weights once
    flops: dict[str, float]  # whole step, all ranks: matmul, other, total (model FLOPs), and
    # recompute, what activation checkpointing adds on top
    memory: dict[str, float]  # worst rank: params, grads, optimizer, activations, workspace,
    # and total, the PEAK (not their sum; `cost.memory.peak_bytes`)
    comm: dict[str, dict[str, float]]  # per kind, on the worst rank: count, payload/wire bytes
    time: dict[str, float]  # compute, recompute, optimizer, comm_exposed, bubble, total
    formulas: dict[str, sympy.Expr]  # "flops.total" -> expression in batch and seq
    uncosted: dict[str, int]  # ops without a compute rule -> occurrences
    peak_flops: float  # of one device, in the plan's math precision (for MFU)
    world_size: int
    # The simulated pipeline step behind time.bubble: each stage's F, B (and W) seconds per
    # microbatch, the reported rank's boundary transfer; print it for the grid. None without
    # a pipeline.
    pipeline: Simulation | None = None
    # Under compile=inductor, the kernels the worst rank's compiled graphs run per microbatch
    # (`cost.fused_kernels`), "forward" and "backward", which its compute is priced by; None in
    # eager mode, priced per op.
    kernels: dict[str, int] | None = None

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
                peak = (group, key) == ("memory", "total")
                label = f"{group}.{key}" + (" (peak)" if peak else "")
                lines.append(f"  {label:<22}{si(value, unit):>12}{shown}")
        for kind, entry in self.comm.items():
            lines.append(
                f"  comm.{kind:<17}{entry['count']:>6.0f} calls, payload "
                f"{si(entry['payload_bytes'], 'B')}, wire {si(entry['wire_bytes'], 'B')}"
            )
        if not self.comm:
            lines.append("  comm                  none")
        if self.kernels is not None:
            lines.append(f"  compute priced as     Inductor's kernels: {self.kernels['forward']} forward, "
                         f"{self.kernels['backward']} backward a microbatch")
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
    program: CompiledProgram,
    *,
    hardware: str | Hardware = "h100",
    optimizer: str = "adamw",
    batch: int | None = None,
    seq: int | None = None,
) -> Estimate:
    """Predict one training step of `program` (see module doc)."""
    device = hardware if isinstance(hardware, Hardware) else hardware_profile(hardware)
    device = device.shared_by(program.mesh.world_size)  # CPU ranks taking turns on a node's cores
    plan, captured = program.plan, program.captured
    sizes = {s.name: v for s, v in captured.example_sizes.items()}
    sizes.update({k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None})
    numbers = {s: sizes[s.name] for s in captured.example_sizes}

    precision = plan.compute_precision
    compute = graph_compute(program)
    params = captured.parameter_count()
    formulas = _step_flops(program, compute)

    # Each candidate rank: without a pipeline all ranks are alike; with one, each pipeline
    # coordinate holds other stages. The worst (by peak memory) is reported.
    mesh = program.mesh
    candidates = [mesh.rank_of(dp=0, pp=i, tp=0) for i in range(mesh.pp)]
    per_rank = {r: _rank_terms(program, r, device, optimizer, precision, numbers) for r in candidates}
    rank = max(candidates, key=lambda r: float(per_rank[r][0]["memory.total"].subs(numbers)))
    rank_formulas, comm, pipeline_run = per_rank[rank]
    formulas.update(rank_formulas)

    values = {k: float(sympy.sympify(v).subs(numbers)) for k, v in formulas.items()}
    pick = lambda group, keys: {k: values[f"{group}.{k}"] for k in keys}  # noqa: E731
    return Estimate(
        plan=str(plan),
        hardware=device.name,
        optimizer=optimizer,
        sizes=sizes,
        rank=rank,
        params=params,
        flops=pick("flops", ("matmul", "other", "total", "recompute")),
        memory=pick("memory", ("params", "grads", "optimizer", "activations", "workspace",
                               "total")),
        comm=comm,
        time=pick("time", ("compute", "recompute", "optimizer", "comm_exposed", "bubble", "total")),
        formulas={k: _rounded(sympy.sympify(v)) for k, v in formulas.items()},
        uncosted=compute.uncosted,
        peak_flops=device.peak_flops[precision],
        world_size=program.world_size,
        pipeline=pipeline_run,
        kernels=compiled_kernel_counts(program, rank) if plan.compile == "inductor" else None,
    )


def _step_flops(program: CompiledProgram, compute) -> dict[str, sympy.Expr]:
    """The FLOPs of the whole step, by kind (`compute`: the graph's op sums); each rank does
    its share of them (`cost.layout`)."""
    formulas = {"flops.matmul": 3 * compute.matmul_flops}
    # rng=exact: each rank draws the whole of every random value (`fxpar.ops.random_streams`).
    drawn = exact_draws(program.graph_module, program.captured.shape)
    formulas["flops.other"] = 3 * compute.other_flops + sum((d.extra_flops for d in drawn), sympy.Integer(0))
    formulas["flops.total"] = formulas["flops.matmul"] + formulas["flops.other"]
    # Not in the total: model FLOPs leave recomputation out (PaLM's MFU; HFU counts it).
    formulas["flops.recompute"] = recompute_flops(program)
    return formulas


def _holding(program: CompiledProgram, rank: int):
    """What `rank` holds: every share of the work (`cost.layout.shares`), those of its pipeline
    coordinate, its parameters (name -> elements) and the tensors its optimizer updates (under
    ZeRO-1/2 one flat shard per bucket, as `runtime.state.sharded_optimizer` steps them)."""
    plan, pipeline = program.plan, program.schedule
    all_shares = shares(program)
    pp_index = program.mesh.coord(rank).pp
    mine = [s for s in all_shares if s.stage is None or pipeline.rank_of(s.stage) == pp_index]
    held = {}
    for piece in mine:
        held.update(piece.parameters)
    buckets = [_buckets(program, s) for s in mine]
    # ZeRO-1/2 step a flat shard per bucket, and whole what is in none (an expert's weights)
    whole = set(meta.unbucketed_parameters(program.graph_module.graph)) & held.keys()
    tensors = sum(len(b) for b in buckets) + len(whole) if plan.zero in (1, 2) else len(held)
    return all_shares, mine, held, tensors


def _buckets(program: CompiledProgram, share) -> tuple:
    """The gradient buckets of the stage `share` is part of (the program's, without a pipeline)."""
    return program.buckets if share.stage is None else program.stages[share.stage].buckets


def _model_state(program: CompiledProgram, held: dict[str, int], optimizer: str) -> tuple[dict, int]:
    """The model state of the parameters a rank holds (name -> elements), and how many of them
    ZeRO shards: all but an expert's weights under ep, which the expert group splits already
    and ZeRO leaves whole (`passes.zero3`)."""
    plan = program.plan
    experts = set(meta.unbucketed_parameters(program.graph_module.graph)) & held.keys()
    dense = sum(n for name, n in held.items() if name not in experts)
    terms = model_state_bytes(dense, precision=plan.precision, optimizer=optimizer, zero=plan.zero, dp=plan.dp,
                              reduce_dtype=plan.reduce_dtype)
    if experts:
        whole = model_state_bytes(sum(held[name] for name in experts), precision=plan.precision, optimizer=optimizer,
                                  zero=0, dp=plan.dp, reduce_dtype=plan.reduce_dtype)
        terms = {key: terms[key] + whole[key] for key in terms}
    return terms, dense


def rank_memory_formulas(program: CompiledProgram, rank: int, *, optimizer: str = "adamw") -> dict[str, sympy.Expr]:
    """`rank`'s memory terms, formulas in batch and seq: the model state of the parameters it
    holds (`params`, `grads`, `optimizer`), the activations of the microbatches it keeps in
    flight, the loss's workspace where the loss is, and the step's peak (`total`,
    `cost.memory.peak_bytes`). The estimate reports the worst rank's; `fxpar.pictures.rank_memory`
    every pipeline coordinate's."""
    plan, pipeline = program.plan, program.schedule
    all_shares, mine, held, tensors = _holding(program, rank)
    terms, parameters = _model_state(program, held, optimizer)
    # The ZeRO paper counts bytes per parameter; Adam also keeps a step counter per tensor.
    terms["optimizer"] += STEP_COUNTER_BYTES[optimizer] * tensors
    local_batch = BATCH / (plan.dp * plan.microbatches)
    in_flight = 1
    if pipeline is not None:
        in_flight = saved_in_flight(pipeline)[program.mesh.coord(rank).pp] / len(mine)
    holds_loss = not pipeline or any(s.stage == len(all_shares) - 1 for s in mine)
    terms["activations"] = (
        rank_activation_bytes(program, rank).subs(BATCH, local_batch) * sympy.nsimplify(round(in_flight, 4))
    )
    # Beside the saved activations (`cost.workspace`): the loss's backward where the loss is, else
    # one op's, ZeRO-3's gathered layers (after the loss's, or beside one op's), and
    # zero-bubble's deferred weight gradients; with a pipeline, its transfers (each already one
    # microbatch of the rank's: no substitution).
    one_op, deferred = backward_bytes(program, rank)
    gathered = gathered_bytes(program, rank)
    if holds_loss:
        loss = loss_workspace_bytes(program.captured)
        backward = sympy.Max(loss, gathered) if gathered else loss
    else:
        backward = one_op + gathered
    terms["workspace"] = (backward + deferred).subs(BATCH, local_batch) + transfer_bytes(program, rank)
    terms["total"] = peak_bytes(
        terms, terms["activations"], terms["workspace"],
        parameters=parameters, precision=plan.precision, zero=plan.zero, dp=plan.dp, microbatches=plan.microbatches,
        reduce_per_microbatch=program.zero_reduce.per_microbatch, reduce_dtype=plan.reduce_dtype,
        released=terms["activations"] / sympy.nsimplify(round(in_flight, 4)),
        largest_bucket=max((b.nbytes for s in mine for b in _buckets(program, s)), default=0),
    )
    return terms


def compiled_kernel_counts(program: CompiledProgram, rank: int) -> dict[str, int]:
    """The kernels `rank`'s compiled graphs run for one microbatch, forward and backward."""
    readable, mine = program.captured.readable, _holding(program, rank)[1]
    read = [graph_kernels(stage_graphs(program, share.stage), readable) for share in mine]
    return {"forward": sum(len(forward) for forward, _ in read), "backward": sum(len(backward) for _, backward in read)}


def piece_times(program: CompiledProgram, pieces, device: Hardware, precision: str) -> dict[int, tuple]:
    """id(share) -> its forward, backward, weight-gradient and recompute seconds, for each
    of `pieces` (`cost.layout` shares): priced by its ops in eager mode
    (`cost.step_time.piece_seconds`), by the kernels Inductor runs for its module under
    `compile=inductor` (`compiled_piece_seconds`)."""
    plan = program.plan
    if plan.compile == "inductor":
        readable, timed = program.captured.readable, {}
        for p in pieces:
            rank, module = stage_module(program, p.stage)
            timed[id(p)] = compiled_piece_seconds(p, module_graphs(program, module, rank), readable, plan, device,
                                                  precision, compiled_calls(module))
        return timed
    return {id(p): piece_seconds(p, plan, device, precision) for p in pieces}


def _rank_terms(program, rank, device, optimizer, precision, numbers):
    """Memory, time and communication formulas of one rank, its comm table and, with a
    pipeline, the simulated step behind its bubble."""
    plan = program.plan
    share = sympy.Rational(1, plan.dp)
    pipeline = program.schedule
    all_shares, mine, held, tensors = _holding(program, rank)
    parameters = sum(held.values())
    pp_index = program.mesh.coord(rank).pp
    formulas = {f"memory.{k}": v for k, v in rank_memory_formulas(program, rank, optimizer=optimizer).items()}

    timed = piece_times(program, all_shares, device, precision)
    forward = sum((timed[id(p)][0] for p in mine), sympy.Integer(0))
    backward = sum((timed[id(p)][1] for p in mine), sympy.Integer(0))
    # rng=exact: the whole value drawn (fp32, written once) for each microbatch.
    stages = {s.stage for s in mine}
    drawn = sum((d.extra_per_rank() for d in exact_draws(program.graph_module, program.captured.shape)
                 if pipeline is None or d.stage in stages), sympy.Integer(0))
    formulas["time.compute"] = forward + backward + device.kernel_seconds(0, 4 * drawn, precision)
    # Activation checkpointing runs the recomputed nodes' forward again, in backward.
    formulas["time.recompute"] = sum((timed[id(p)][3] for p in mine), sympy.Integer(0))
    updated = parameters * (share if plan.zero >= 1 else 1)
    formulas["time.optimizer"] = optimizer_seconds(optimizer, tensors, updated, device)
    formulas["time.bubble"] = sympy.Integer(0)
    run = None
    if pipeline is not None:
        # The schedule's idle time, from the simulator with this size's stage times (GPipe
        # Sec. 2.3; Narayanan et al. 2021 Sec. 2.2): the bubble term is a simulation, not a
        # closed form, so uneven stages and interleaving are priced as they run.
        # A transfer between stages sits on the critical path: the simulator adds one boundary
        # send (alpha-beta, the largest boundary of a microbatch) between dependent actions.
        # A split schedule (zb-h1) runs the weight gradients apart, as W: B is the rest.
        m = plan.microbatches
        f, b, w, r = ([float(timed[id(p)][i].subs(numbers)) / m for p in all_shares] for i in range(4))
        b = [backward + recompute for backward, recompute in zip(b, r)]  # B recomputes
        if pipeline.splits_backward:
            b = [whole - weight for whole, weight in zip(b, w)]
        else:
            w = [0.0] * len(b)
        transfers = [c for c in program.collectives(rank) if c.kind == "send"]
        hop = max(
            (float(collective_time("send", c.payload_bytes, 2, device.link(c.group)))
             for c in transfers),
            default=0.0,
        )
        run = simulate(pipeline, f, b, weight_cost=w, comm_cost=hop)
        formulas["time.bubble"] = sympy.Float(float(run.total - run.busy[pp_index]))

    formulas["time.comm_exposed"], comm = comm_terms(program, program.step_program(rank), device, forward, backward)
    formulas["time.total"] = sum(
        formulas[f"time.{k}"] for k in ("compute", "recompute", "optimizer", "comm_exposed", "bubble")
    )
    return formulas, comm, run


def exposed_comm_seconds(program: CompiledProgram, device: Hardware,
                         step_program: Callable[[int], StepProgram]) -> tuple[float, float]:
    """The estimate's `time.comm_exposed` at the example's sizes on the pipeline coordinate
    that exposes the most, and that rank's forward and backward compute seconds, without the
    memory terms (which need a fake forward): what the two ways of reducing ZeRO's gradients
    differ in, and the scale it is judged at (`fxpar.plan.zero_reduction`). `step_program(rank)`
    lowers the rank's step in the mode being priced (`Program.zero_reduce`)."""
    plan, mesh = program.plan, program.mesh
    numbers = dict(program.captured.example_sizes)
    worst = (0.0, 0.0)
    for rank in (mesh.rank_of(dp=0, pp=i, tp=0) for i in range(mesh.pp)):
        mine = _holding(program, rank)[1]
        timed = piece_times(program, mine, device, plan.compute_precision).values()
        forward = sum((t[0] for t in timed), sympy.Integer(0))
        backward = sum((t[1] for t in timed), sympy.Integer(0))
        exposed, _ = comm_terms(program, step_program(rank), device, forward, backward)
        seconds = (float(sympy.sympify(exposed).subs(numbers)), float(sympy.sympify(forward + backward).subs(numbers)))
        worst = max(worst, seconds)
    return worst


def _rounded(expr: sympy.Expr) -> sympy.Expr:
    """Floats in a formula shown to 4 significant digits; integers and fractions kept exact.
    (Not `sympy.nsimplify`, whose search for a closed form took most of the planner's time.)"""
    return expr.xreplace({f: sympy.Float(f, 4) for f in expr.atoms(sympy.Float)})


def _short(expr: sympy.Expr) -> str:
    text = str(expr)
    return text if len(text) <= 90 else text[:87] + "..."


_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float, unit: str) -> str:
    """`value` with an SI prefix ("3.200 MB"), seconds as ms below one ("0.740 ms")."""
    if unit == "s":
        return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.3f} s"
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.3f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


