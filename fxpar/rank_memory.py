"""Predicted memory of every pipeline rank, not only the worst one the estimate reports.

`program.estimate()` prices each pipeline coordinate and reports the rank with the largest
peak. The memory chart and the plan diff want all of them, term by term:

    predicted_memory(program)   {0: {"params": ..., "grads": ..., "optimizer": ...,
                                     "activations": ..., "workspace": ..., "total": ...}, 2: ...}

keyed by the rank `estimate()` would report for that coordinate (`mesh.rank_of(pp=i)`): its
data- and tensor-parallel peers hold the same. The terms are the estimate's own (`cost.estimate`,
"Memory", and `cost.memory`), built from the same public pieces: the rank's share of the work
(`cost.layout.shares`), the model state of the parameters it holds by precision and ZeRO stage
(`cost.memory.model_state_bytes`, plus Adam's step counters), the bytes its modules save for
backward (`cost.activations.rank_activation_bytes`) times the microbatches it keeps in flight
under the schedule, the loss's backward workspace where the
loss is, and the peak (`cost.memory.peak_bytes`). `total` is that peak, not the sum.
tests/test_report.py holds the worst rank's figures equal to `estimate().memory`.
"""

from __future__ import annotations

import sympy

from fxpar.compiled_program import CompiledProgram
from fxpar.cost.activations import backward_workspace_bytes, rank_activation_bytes, saved_in_flight
from fxpar.cost.layout import shares
from fxpar.cost.memory import model_state_bytes, peak_bytes
from fxpar.cost.optimizer import STEP_COUNTER_BYTES
from fxpar.symbols import BATCH

TERMS = ("params", "grads", "optimizer", "activations", "workspace")


def predicted_memory(program: CompiledProgram, *, optimizer: str = "adamw") -> dict[int, dict[str, float]]:
    """Bytes of each memory term on one rank per pipeline coordinate (see module doc), at the
    example's batch and seq."""
    plan, mesh, schedule = program.plan, program.mesh, program.schedule
    captured = program.captured
    numbers = dict(captured.example_sizes)
    local_batch = BATCH / (plan.dp * plan.microbatches)
    every = shares(program)
    peaks = saved_in_flight(schedule) if schedule is not None else None
    result = {}
    for pp in range(mesh.pp):
        mine = [s for s in every if s.stage is None or schedule.rank_of(s.stage) == pp]
        held = {name: n for s in mine for name, n in s.parameters.items()}
        state = model_state_bytes(sum(held.values()), precision=plan.precision, optimizer=optimizer,
                                  zero=plan.zero, dp=plan.dp, reduce_dtype=plan.reduce_dtype)
        buckets = [program.stages[s.stage].buckets for s in mine] if schedule else [program.buckets]
        tensors = sum(len(b) for b in buckets) if plan.zero >= 1 else len(held)
        state["optimizer"] += STEP_COUNTER_BYTES[optimizer] * tensors
        in_flight = peaks[pp] / len(mine) if peaks is not None else 1
        rank = mesh.rank_of(pp=pp)
        terms = dict(state)
        terms["activations"] = (rank_activation_bytes(program, rank).subs(BATCH, local_batch)
                                * sympy.nsimplify(round(in_flight, 4)))
        holds_loss = schedule is None or any(s.stage == len(every) - 1 for s in mine)
        workspace = backward_workspace_bytes(captured) if holds_loss else sympy.Integer(0)
        terms["workspace"] = workspace.subs(BATCH, local_batch)
        terms["total"] = peak_bytes(state, terms["activations"], terms["workspace"],
                                    parameters=sum(held.values()), precision=plan.precision,
                                    zero=plan.zero, dp=plan.dp, microbatches=plan.microbatches)
        result[rank] = {k: float(sympy.sympify(v).subs(numbers)) for k, v in terms.items()}
    return result
