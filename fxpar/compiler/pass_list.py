"""The passes a plan compiles with: one list built from the plan, printable, run by `run_passes`.

`pass_list(plan, captured, mesh=..., hardware=...)` is the only place that decides which
passes run and in which order; `compile` runs `graph` on the captured graph, and, with a
pipeline, splits the result into stages and runs `stage` on each (every pass, on either side
of the split, a `GraphModule -> GraphModule` whose contract `run_passes` checks). Options are
bound with `functools.partial`, so `print(program.passes)` shows the whole pipeline:

    graph: normalise_loss
           cast_to_bf16                          (precision=bf16-mixed)
           shard_tensor_parallel(placements=..., tp=2, sequence_parallel=False, ...)
           place_data_parallel(batch=frozenset({s35}))
           make_statistics_global(dp=2)          (a loss adding a router's balancing loss)
           draw_from_streams(exact=False, dp=2, tp=2, microbatches=1)   (a model that draws)
           assign_stages(stages=2, split=(), cost=..., memory=..., in_flight=(2.0, 1.0))
    stage: defer_weight_gradients
           assign_gradient_buckets(bucket_bytes=1048576, mesh=Mesh(dp=2, pp=2, tp=2))
           mark_recomputation(mode='full', blocks=('h',))

[Note: pass order] The loss becomes sum / global count first, so that every later rewrite
(the vocabulary-parallel loss, the pipeline's last stage) works on the sum. Mixed precision
follows: every later pass, and the ops it inserts, sees the dtypes a rank computes in. Tensor
parallelism runs next: it decides which parameters are split, and gradient buckets are sized
by the shards each rank really holds. Placements on the dp axis follow, over the ops tensor
parallelism inserted too; they say which values reduce the rank's tokens, which a loss term
of batch statistics then takes over the whole batch (`passes.batch_statistics`). A chunked loss replaces the whole-vocabulary cross entropies the
tensor-parallel rewrite left (`passes.chunked_loss`), taking the loss's placements. Random ops are given their streams once both axes are placed (a
draw's slice is read from its placements) and before the cut, so that they are numbered in
the whole graph's order (`passes.random_draws`). The pipeline cut comes after: stages hold tensor-parallel shards,
and each stage's buckets hold only that stage's parameters, so buckets are a stage pass; a
zero-bubble stage defers its linear weights' gradients before its buckets are drawn up.
Activation checkpointing marks its regions last, on the graph each rank runs, so that what
earlier passes inserted is marked too and their collectives are left out
(`passes.activation_checkpoint`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import torch

from fxpar.compiler.pipeline_program import node_memory, node_time, schedule_in_flight
from fxpar.cost.collectives import MiB, gradient_bucket_bytes
from fxpar.cost.profiles import hardware_profile
from fxpar.errors import PlanError
from fxpar.frontend.trace import CapturedGraph
from fxpar.ir import meta
from fxpar.ir.mesh import Mesh
from fxpar.ir.placement import Placements, Shard, local_shape
from fxpar.ir.recompute_regions import FULL, SELECTIVE, attention_cores, block_lists
from fxpar.ops.chunked_loss import ROWS
from fxpar.passes.activation_checkpoint import mark_recomputation
from fxpar.passes.chunked_loss import chunk_cross_entropy
from fxpar.passes.context_parallel import split_sequence
from fxpar.passes.data_parallel import assign_gradient_buckets
from fxpar.passes.dp_placement import place_data_parallel
from fxpar.passes.batch_statistics import make_statistics_global, refuse_batch_pieces
from fxpar.passes.expert_parallel import split_experts
from fxpar.passes.infra import GraphPass, pass_name
from fxpar.passes.loss_normalisation import normalise_loss, statistics_term
from fxpar.passes.mixed_precision import cast_to_bf16
from fxpar.passes.pipeline import assign_stages
from fxpar.passes.random_draws import draw_from_streams, draws_randomness
from fxpar.passes.tensor_parallel.rewrite import shard_tensor_parallel
from fxpar.passes.tensor_parallel.rules import UNSUPPORTED_HF_STYLES, parameter_placements, rules_matching_nothing
from fxpar.passes.weight_gradients import defer_weight_gradients
from fxpar.passes.zero3 import shard_parameters
from fxpar.plan.plan import Plan
from fxpar.schedule.schedules import Schedule, schedule


@dataclass(frozen=True)
class PassList:
    """The passes of one compile: on the whole graph, then on each pipeline stage."""

    graph: tuple[GraphPass, ...]
    stage: tuple[GraphPass, ...] = ()  # empty without a pipeline
    # The pipeline's schedule, which the stage cut sizes its memory by and the program runs
    # (`Program.schedule` is this object); None without a pipeline.
    schedule: Schedule | None = None

    def __str__(self) -> str:
        lines = []
        for side, passes in (("graph", self.graph), ("stage", self.stage)):
            for i, graph_pass in enumerate(passes):
                lines.append(f"{side + ':' if i == 0 else '':<7}{pass_name(graph_pass)}")
        return "\n".join(lines)


def pass_list(plan: Plan, captured: CapturedGraph, *, mesh: Mesh, hardware: str) -> PassList:
    """The passes `plan` compiles `captured` with, in order (module doc)."""
    graph: list[GraphPass] = [normalise_loss]
    if plan.precision == "bf16-mixed":
        graph.append(cast_to_bf16)
    if plan.tp > 1:
        placements = parameter_placements(captured.graph_module, _tensor_parallel_rules(plan, captured), tp=plan.tp)
        _warn_when_little_is_split(placements, captured, plan)
        graph.append(partial(
            shard_tensor_parallel, placements=placements, tp=plan.tp,
            sequence_parallel=plan.sequence_parallel, seq=frozenset(captured.export_symbols("seq")),
            gathered_outputs=placements.gathered_outputs, loss_rows=ROWS if plan.loss == "chunked" else None,
        ))
    if plan.cp > 1:
        graph.append(_context_parallel(plan, captured))
    if plan.ep > 1:
        graph.append(partial(split_experts, ep=plan.ep, dispatch=plan.dispatch))
    graph.append(partial(place_data_parallel, batch=frozenset(captured.export_symbols("batch"))))
    if (term := statistics_term(captured.graph_module)) is not None:
        refuse_batch_pieces(term, microbatches=plan.microbatches, pp=plan.pp, cp=plan.cp)
        graph.append(partial(make_statistics_global, dp=plan.dp))
    if plan.loss == "chunked":
        graph.append(chunk_cross_entropy)
    if draws_randomness(captured.graph_module):
        graph.append(partial(draw_from_streams, exact=plan.rng == "exact", dp=plan.dp, tp=plan.tp,
                             microbatches=plan.microbatches))
    buckets = partial(assign_gradient_buckets, bucket_bytes=_bucket_bytes(plan, mesh, hardware), mesh=mesh,
                      hold=plan.zero >= 1, **_reduce_dtype(plan))
    # ZeRO-3 after the buckets (which say what is trained); with dp=1 nothing is sharded.
    zero3 = (partial(shard_parameters, mesh=mesh, reshard_after_forward=plan.reshard_after_forward,
                     **_reduce_dtype(plan)),
             ) if plan.zero == 3 and mesh.dp > 1 else ()
    last = (buckets, *zero3, *_recomputation(plan, captured))
    stages = plan.pp * plan.virtual_stages
    if stages == 1:
        return PassList(graph=(*graph, *last))
    pipeline = schedule(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    graph.append(partial(
        assign_stages, stages=stages, split=plan.split,
        cost=node_time(captured, hardware_profile(hardware, measured=False), precision=plan.compute_precision),
        memory=node_memory(captured, microbatch=_rank_microbatch(plan, captured, mesh), plan=plan),
        in_flight=schedule_in_flight(pipeline),
    ))
    per_stage = (defer_weight_gradients, *last) if pipeline.splits_backward else last
    return PassList(graph=tuple(graph), stage=per_stage, schedule=pipeline)


def _context_parallel(plan: Plan, captured: CapturedGraph) -> GraphPass:
    """The sequence split over cp; a PlanError for a model that draws randomness, which cp
    does not yet draw as one device does."""
    if draws_randomness(captured.graph_module):
        raise PlanError(
            f"plan cp={plan.cp}: this model draws random numbers (dropout), and context "
            "parallelism does not yet give each rank the draws of its slice of the sequence. "
            "Fix: set the model's dropout probabilities to 0 (model.eval() keeps them from "
            "drawing in a Hugging Face model's attention too), or cp=1",
            field="cp", value=plan.cp)
    return partial(split_sequence, cp=plan.cp, seq=frozenset(captured.export_symbols("seq")))


def _recomputation(plan: Plan, captured: CapturedGraph) -> tuple[GraphPass, ...]:
    """The checkpoint pass for the plan's `checkpoint`, with the model's block lists found on
    the whole captured graph (a pipeline stage holds only some blocks); a PlanError where the
    model has nothing to checkpoint."""
    if plan.checkpoint == "none":
        return ()
    graph = captured.graph_module.graph
    blocks = block_lists(graph)
    if plan.checkpoint == FULL and not blocks:
        raise PlanError(
            "plan checkpoint=full recomputes each transformer block, and this model has no "
            "block list: no module whose children are named 0, 1, 2, ... (at least two) and "
            "are all of one class, as GPT-2's transformer.h or Llama's model.layers. Fix: keep "
            "the repeated layers in an nn.ModuleList, or checkpoint=selective (attention's "
            "core only), or checkpoint=none",
            field="checkpoint",
            value=plan.checkpoint,
        )
    if plan.checkpoint == SELECTIVE and not attention_cores(graph):
        raise PlanError(
            "plan checkpoint=selective recomputes attention's core (QK^T, softmax, dropout, "
            "attention over V, or one scaled_dot_product_attention), and this model has none. "
            "Fix: checkpoint=full (every block) or checkpoint=none",
            field="checkpoint",
            value=plan.checkpoint,
        )
    # eager mode recomputes cp's key and value gathers; a compiled graph's partitioner keeps them
    regather = {"regather": True} if plan.cp > 1 and plan.compile == "eager" else {}
    return (partial(mark_recomputation, mode=plan.checkpoint, blocks=blocks, **regather),)


def _rank_microbatch(plan: Plan, captured: CapturedGraph, mesh: Mesh) -> int:
    """A rank's share of one microbatch of the example's batch (`placement.local_shape`)."""
    (batch,) = local_shape((captured.example_batch // plan.microbatches,), Placements(dp=Shard(0)), mesh.sizes)
    return batch


def _reduce_dtype(plan: Plan) -> dict[str, torch.dtype]:
    """bf16-mixed's gradients (bf16) are reduced over dp in the plan's `reduce_dtype`."""
    if plan.precision != "bf16-mixed":
        return {}
    return {"reduce_dtype": torch.bfloat16 if plan.reduce_dtype == "bf16" else torch.float32}


def _bucket_bytes(plan: Plan, mesh: Mesh, hardware: str) -> int:
    """The plan's `bucket_mb`, or the cost model's size for the dp degree (`cost.collectives`)."""
    if plan.bucket_mb is not None:
        return int(plan.bucket_mb * MiB)
    # Nominal, never measured, constants: every rank must choose the same buckets.
    return gradient_bucket_bytes(mesh.dp, hardware_profile(hardware, measured=False).intra_node)


def _tensor_parallel_rules(plan: Plan, captured: CapturedGraph) -> dict[str, str] | str:
    """The plan's tp_rules with the model's own plans in place of "auto" and "model"."""
    declared = captured.declared_plans
    if plan.tp_rules == "auto":
        return _declared_rules(declared.base, captured, "auto") or "infer"
    if plan.tp_rules == "model":
        if not declared.whole:
            raise PlanError(
                "plan tp_rules=model asks for the model's own tensor-parallel plan, and this "
                "model declares none (no Hugging Face base_model_tp_plan or _tp_plan). Fix: "
                "tp_rules=auto (Megatron's layout, inferred) or a mapping of module globs to styles",
                field="tp_rules",
                value="model",
            )
        return _declared_rules(declared.whole, captured, "model")
    return plan.tp_rules


LITTLE_SPLIT = 0.5  # a tp plan splitting less of the parameters than this is worth a warning


def _warn_when_little_is_split(placements: dict, captured: CapturedGraph, plan: Plan) -> None:
    """One warning when tensor parallelism splits under half of the parameters (Mamba's mixers
    match no projection rule: only its embedding is split): every rank then holds and computes
    the rest whole, and the plan buys little for its collectives. Silence is what a user would
    take for tp working."""
    sizes = {name: node.meta["val"].numel() for name, node in meta.parameter_nodes(captured.graph_module.graph).items()
             if name in placements}
    split = [name for name in sizes if isinstance(placements[name], Shard)]
    share = sum(sizes[name] for name in split) / max(sum(sizes.values()), 1)
    if share < LITTLE_SPLIT:
        named = ", ".join(repr(name) for name in split[:3]) + (", ..." if len(split) > 3 else "")
        warnings.warn(
            f"plan tp={plan.tp} splits only {share:.0%} of the parameters ({len(split)} of {len(sizes)} "
            f"tensors{': ' + named if split else ''}); every rank holds and computes the other "
            f"{1 - share:.0%} whole. Fix: name the modules to split in tp_rules, or spend these "
            "ranks on dp (with zero) or pp",
            stacklevel=5,
        )


def _declared_rules(rules: dict[str, str], captured: CapturedGraph, asked: str) -> dict[str, str]:
    """A model's own plan as fxpar can follow it, with one warning for each kind of change.

    Entries this configuration has no module for are skipped: a model family declares one plan
    for all its configurations (a shared expert, dense MLPs beside the experts) and
    transformers skips what a given one lacks. Entries in a style fxpar does not do
    (`moe_tp_experts`, `mla_kv_a_proj`: `rules.UNSUPPORTED_HF_STYLES`) keep their modules
    whole, and the entries inside them go: replicating is exact, so the model still trains
    as one device, with less split. The user wrote none of these globs, so none is the user's
    error; a user's own `tp_rules` mapping stays strict (`rules._match_rules`)."""
    unmatched = rules_matching_nothing(captured.graph_module, rules)
    if unmatched:
        warnings.warn(
            f"plan tp_rules={asked}: the model's own tensor-parallel plan has "
            f"{len(unmatched)} entr{'y' if len(unmatched) == 1 else 'ies'} that match no module of "
            f"this configuration, skipped as transformers skips them: "
            f"{', '.join(repr(p) for p in unmatched)}",
            stacklevel=6,
        )
    kept = {p: s for p, s in rules.items() if p not in unmatched}
    unhonoured = {p: s for p, s in kept.items() if s in UNSUPPORTED_HF_STYLES}
    if unhonoured:
        inside = [p for p in kept if any(p.startswith(u + ".") for u in unhonoured)]
        warnings.warn(
            f"plan tp_rules={asked}: the model's own tensor-parallel plan asks for what fxpar's "
            "tensor parallelism does not do, so those modules stay whole on every rank: "
            + "; ".join(f"{p!r}: {s!r} ({UNSUPPORTED_HF_STYLES[s]})" for p, s in unhonoured.items())
            + (f" (and the {len(inside)} entries inside them)" if inside else ""),
            stacklevel=6,
        )
        kept = {p: "replicate" if p in unhonoured else s for p, s in kept.items() if p not in inside}
    return kept
