"""The plan's fields against each other: options that need another setting, what compiled mode
does not cover, and the pipeline's schedule against its microbatches and stages.

`Plan.__post_init__` checks each field's own value (`fxpar.plan.text`), then calls these, so a
plan that exists is one whose fields make sense together. Each refusal is a `PlanError` naming
the field, the value, the setting it conflicts with and a fix: an option is never silently
ignored. Each function takes the `fxpar.plan.plan.Plan` being built (not imported here: the
plan module imports this one).
"""

from __future__ import annotations

import math

from fxpar.errors import PlanError
from fxpar.plan.text import text_of


def check_options_apply(plan) -> None:
    """Options that only one setting uses are refused without it: never silently ignored."""
    check_compiled(plan)
    check_context_parallel(plan)
    check_expert_parallel(plan)
    if plan.reduce_dtype != "fp32" and plan.precision != "bf16-mixed":
        raise PlanError(
            f"plan reduce_dtype={plan.reduce_dtype} sets the dtype bf16-mixed training "
            f"reduces gradients in, and precision={plan.precision}. Fix: add "
            "precision=bf16-mixed, or drop reduce_dtype",
            field="reduce_dtype",
            value=plan.reduce_dtype,
        )
    if plan.zero_reduce != "auto" and plan.zero not in (2, 3):
        raise PlanError(
            f"plan zero_reduce={plan.zero_reduce} says when ZeRO-2 and 3 reduce-scatter "
            f"gradients, and zero={plan.zero}"
            + (": ZeRO-1 keeps every gradient whole and reduces once per step" if plan.zero == 1 else "")
            + ". Fix: zero=2 or zero=3, or drop zero_reduce",
            field="zero_reduce",
            value=plan.zero_reduce,
        )
    if plan.zero == 2 and plan.zero_reduce == "microbatch" and plan.schedule == "zb-h1" and plan.pp > 1:
        raise PlanError(
            "plan zero=2 zero_reduce=microbatch with schedule=zb-h1: the zero-bubble schedule "
            "runs a later microbatch's B (its bias and norm gradients) before an earlier one's "
            "W (its weight gradients), so no point of the step holds exactly one microbatch's "
            "gradients to reduce-scatter. Fix: zero_reduce=step, or schedule=1f1b",
            field="zero_reduce",
            value=plan.zero_reduce,
        )
    for name, default in (("prefetch", None), ("reshard_after_forward", True)):
        if getattr(plan, name) != default and plan.zero != 3:
            raise PlanError(
                f"plan {name}={text_of(getattr(plan, name))} tunes how ZeRO-3 gathers "
                f"parameters, and zero={plan.zero}. Fix: add zero=3, or drop {name}",
                field=name,
                value=getattr(plan, name),
            )


def check_compiled(plan) -> None:
    """What `compile=inductor` does not cover, refused (`fxpar.runtime.compiled_forward`)."""
    if plan.compile != "inductor":
        return
    if plan.zero == 3 and plan.gathers_ahead > 1:
        raise PlanError(
            f"plan compile=inductor with prefetch={plan.prefetch}: a compiled ZeRO-3 graph "
            "gathers a layer while the one before it computes (prefetch=1, the default) or "
            "where the layer reads it (prefetch=0), never more layers ahead "
            "(runtime.collective_schedule). Fix: prefetch=1, or compile=eager to gather further ahead",
            field="prefetch",
            value=plan.prefetch,
        )
    if plan.ep > 1 and plan.dispatch == "alltoall":
        raise PlanError(
            f"plan compile=inductor with ep={plan.ep} dispatch=alltoall: the rows each rank "
            "receives are sized by the router when the step runs, and a compiled graph's "
            "shapes are fixed when it is traced. Fix: compile=eager, or dispatch=allgather "
            "(every shape static), or ep=1",
            field="compile",
            value=plan.compile,
        )
    if plan.zero == 3 and plan.zero_reduce == "step" and plan.dp > 1:
        raise PlanError(
            "plan compile=inductor with zero=3 zero_reduce=step: a compiled backward "
            "reduce-scatters each layer's gradients as it computes them, once per microbatch. "
            "Fix: drop zero_reduce, or compile=eager to reduce once per step",
            field="zero_reduce",
            value=plan.zero_reduce,
        )


def check_context_parallel(plan) -> None:
    """Context parallelism (`cp`) with tensor parallelism's own sequence shards, refused."""
    if plan.cp > 1 and plan.sequence_parallel:
        raise PlanError(
            f"plan cp={plan.cp} with sp=true: both split the sequence, cp over its ranks for the "
            "whole model and sp over the tp ranks around the norms, and fxpar does not yet nest "
            "tp's sequence shards inside cp's. Fix: sp=false (cp already splits the norms' "
            "activations cp ways), or cp=1",
            field="sequence_parallel",
            value=True,
        )


def check_expert_parallel(plan) -> None:
    """Expert parallelism (`ep`) is carved from the data-parallel ranks: ep must divide dp;
    `dispatch` says how ep moves tokens, so it needs ep."""
    if plan.dispatch != "alltoall" and plan.ep == 1:
        raise PlanError(
            f"plan dispatch={plan.dispatch} says how expert parallelism moves tokens to their "
            "experts, and ep=1. Fix: add ep=2 (or more, dividing dp), or drop dispatch",
            field="dispatch",
            value=plan.dispatch,
        )
    if plan.dp % plan.ep:
        raise PlanError(
            f"plan ep={plan.ep} with dp={plan.dp}: expert parallelism splits the experts over "
            "groups of ep data-parallel ranks (carved from dp, as Megatron-Core and torchtitan "
            f"do: each rank keeps its own slice of the batch), so ep must divide dp. Fix: "
            f"dp={plan.dp * plan.ep // math.gcd(plan.dp, plan.ep)} ep={plan.ep}, or ep=1",
            field="ep",
            value=plan.ep,
        )


def check_pipeline(plan) -> None:
    interleaved = plan.schedule == "interleaved"
    if interleaved != (plan.virtual_stages > 1):
        raise PlanError(
            f"schedule={plan.schedule} with virtual_stages={plan.virtual_stages}: the "
            "interleaved schedule needs virtual_stages >= 2, and only it uses them. Fix: "
            "schedule=interleaved virtual_stages=2, or virtual_stages=1",
            field="virtual_stages",
            value=plan.virtual_stages,
        )
    stages = plan.pp * plan.virtual_stages
    if plan.pp > 1 and plan.schedule in ("1f1b", "interleaved", "zb-h1") and plan.microbatches < plan.pp:
        raise PlanError(
            f"schedule={plan.schedule} with pp={plan.pp} needs at least {plan.pp} microbatches "
            f"(one in flight per stage), got mb={plan.microbatches}. Fix: mb={plan.pp} or "
            f"more (GPipe Sec. 2.3: the bubble is negligible from mb >= 4 pp = {4 * plan.pp})",
            field="microbatches",
            value=plan.microbatches,
        )
    if interleaved and plan.microbatches % plan.pp:
        raise PlanError(
            f"the interleaved schedule processes microbatches in groups of pp={plan.pp}; "
            f"mb={plan.microbatches} is not a multiple. Fix: mb={plan.microbatches + plan.pp - plan.microbatches % plan.pp}",
            field="microbatches",
            value=plan.microbatches,
        )
    if plan.split and len(plan.split) != stages - 1:
        raise PlanError(
            f"split names {len(plan.split)} stage starts, but pp x virtual_stages = {stages} "
            f"stages need {stages - 1}. Fix: name {stages - 1} module paths",
            field="split",
            value=list(plan.split),
        )
