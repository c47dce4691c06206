"""Compilation: what `fxpar.compile` does to a capture for a plan, before it makes the Program.

    capture + plan
      -> the plan checked against the example batch      (`check_batch_fits`)
      -> the pass list built from the plan, run          (`fxpar.compiler.pass_list`)
      -> warnings where a step will differ from one device's
         (a mean loss over unequal pieces, BatchNorm's batch statistics, ZeRO with dp=1)
      -> with a pipeline, the graph cut into its stages  (`pipeline_program.build_stages`)

`compile_graph` returns what a `fxpar.compiler.program.Program` is made of (`CompiledGraph`);
`fxpar.compiler.program.compile` builds the Program from it and proves it. This module never imports the
program module: a Program pickles by compiling again (`Program.__reduce__`), so the program
module calls this one, and nothing here may call back.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar.compiler.pass_list import PassList, pass_list
from fxpar.compiler.pipeline_program import build_stages
from fxpar.errors import PlanError
from fxpar.frontend.model_io import ExampleInputs
from fxpar.frontend.state_writes import batch_statistics_modules
from fxpar.frontend.trace import CapturedGraph, capture
from fxpar.ir import meta
from fxpar.ir.loss_reduction import LossReduction
from fxpar.ir.mesh import Mesh
from fxpar.ir.stages import Stage
from fxpar.passes.infra import run_passes
from fxpar.plan.plan import Plan


@dataclass(frozen=True, kw_only=True)
class CompiledGraph:
    """The compiled job before it is a Program: the mesh, the graph after every pass, the
    pipeline stages (None without a pipeline) and the pass list that ran."""

    mesh: Mesh
    graph_module: fx.GraphModule
    stages: tuple[Stage, ...] | None
    passes: PassList


def captured_of(model: torch.nn.Module | CapturedGraph, example_inputs: ExampleInputs | None) -> CapturedGraph:
    """`model` captured at `example_inputs`, or `model` itself when it is a capture already
    (then `example_inputs` must not be given: the capture has them)."""
    if isinstance(model, CapturedGraph):
        if example_inputs is not None:
            raise TypeError("compile(capture, plan) takes no example_inputs: the capture has them")
        return model
    if example_inputs is None:
        raise TypeError("fxpar.compile(model, plan, example_inputs): the example inputs are missing")
    return capture(model, example_inputs)


def compile_graph(captured: CapturedGraph, plan: Plan, *, hardware: str) -> CompiledGraph:
    """Check `plan` against `captured`, run its passes, warn, and cut the stages (module doc).

    Called by `fxpar.compile` (whose caller the warnings name) and by nothing else."""
    check_batch_fits(plan, captured)
    mesh = Mesh.from_plan(plan)
    passes = pass_list(plan, captured, mesh=mesh, hardware=hardware)
    graph_module = run_passes(captured.graph_module, passes.graph)
    _warn_unless_exact_loss(plan, meta.graph_loss(graph_module))
    _warn_of_batch_statistics(plan, captured)
    if plan.zero and plan.dp == 1:
        warnings.warn(f"fxpar: plan zero={plan.zero} shards model state over the data-parallel ranks, "
                      "and dp=1: nothing is sharded. Fix: dp=2 or more, or drop zero", stacklevel=3)
    stages = build_stages(graph_module, stage_passes=passes.stage) if passes.stage else None
    return CompiledGraph(mesh=mesh, graph_module=graph_module, stages=stages, passes=passes)


def check_batch_fits(plan: Plan, captured: CapturedGraph) -> None:
    """The example's global batch splits into the plan's pieces, the captured graph lets it
    (its batch size is a symbol), and sequence parallelism can split its sequence length."""
    plan.check_batch(captured.example_batch)
    if plan.dp * plan.microbatches > 1 and captured.batch is None:
        raise PlanError(
            f"the captured graph fixes the batch size to {captured.example_batch}: the model "
            "uses its batch size as a constant (for example `x.view(8, ...)`), but the plan "
            f"splits each batch {plan.dp * plan.microbatches} ways. Fix: read sizes from the "
            "input (`B, T = idx.shape`) or use -1 in views",
            field="dp",
            value=plan.dp,
        )
    if (seq := captured.symbols.get("seq")) is not None:
        plan.check_sequence(captured.example_sizes[seq], what="the example's sequence length")


def _warn_unless_exact_loss(plan: Plan, reduction: LossReduction) -> None:
    if reduction.sums or plan.dp * plan.microbatches == 1:
        return
    warnings.warn(
        f"fxpar: {reduction.reason}, so the plan's {plan.dp * plan.microbatches} pieces of each "
        "batch (dp x microbatches) are averaged as means: equal to one device only when every "
        "piece weighs the same (no padding, no ignored targets). A mean cross entropy "
        "(F.cross_entropy, Hugging Face's loss) is exact under any split",
        stacklevel=4,
    )


def _warn_of_batch_statistics(plan: Plan, captured: CapturedGraph) -> None:
    pieces = plan.dp * plan.microbatches
    if pieces > 1 and (modules := batch_statistics_modules(captured.graph_module.graph)):
        named = f"module {modules[0]!r} normalises" if len(modules) == 1 else (
            f"modules {', '.join(repr(m) for m in modules[:3])} normalise")
        warnings.warn(
            f"fxpar: {named} with the statistics of its input batch (BatchNorm in training "
            "mode), and the plan splits each batch "
            f"into {pieces} pieces (dp x microbatches): each piece is normalised by its own "
            "statistics, so the step differs from one device's (SyncBatchNorm is not "
            "supported). Fix: `.eval()` on the module before capture (it then normalises with its "
            "running statistics), or LayerNorm / GroupNorm",
            stacklevel=4,
        )
