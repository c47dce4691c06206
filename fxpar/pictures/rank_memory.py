"""Predicted memory of every pipeline rank, not only the worst one the estimate reports.

`program.estimate()` prices each pipeline coordinate and reports the rank with the largest
peak. The memory chart and the plan diff want all of them, term by term:

    predicted_memory(program)   {0: {"params": ..., "grads": ..., "optimizer": ...,
                                     "activations": ..., "workspace": ..., "total": ...}, 2: ...}

keyed by the rank `estimate()` would report for that coordinate (`mesh.rank_of(pp=i)`): its
data- and tensor-parallel peers hold the same. The terms are the estimate's own, from the one
function that builds them (`cost.estimate.rank_memory_formulas`): the model state of the
parameters the rank holds by precision and ZeRO stage (`cost.memory.model_state_bytes`, plus
Adam's step counters), the bytes its modules save for backward times the microbatches it keeps
in flight under the schedule, the loss's backward workspace where the loss is, and the peak
(`cost.memory.peak_bytes`). `total` is that peak, not the sum.
tests/test_report.py holds the worst rank's figures equal to `estimate().memory`.
"""

from __future__ import annotations

import sympy

from fxpar.cost.estimate import rank_memory_formulas
from fxpar.ir.compiled_program import CompiledProgram

TERMS = ("params", "grads", "optimizer", "activations", "workspace")


def predicted_memory(program: CompiledProgram, *, optimizer: str = "adamw") -> dict[int, dict[str, float]]:
    """Bytes of each memory term on one rank per pipeline coordinate (see module doc), at the
    example's batch and seq."""
    numbers = dict(program.captured.example_sizes)
    result = {}
    for pp in range(program.mesh.pp):
        rank = program.mesh.rank_of(pp=pp)
        terms = rank_memory_formulas(program, rank, optimizer=optimizer)
        result[rank] = {k: float(sympy.sympify(v).subs(numbers)) for k, v in terms.items()}
    return result
