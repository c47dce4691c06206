"""Tier 1: pipeline stage cuts, stage graphs and their errors, without processes."""

import sys
from pathlib import Path

import pytest
import torch

from fxpar import PlanError
import fxpar
from fxpar.compiler.pipeline_program import issue_order, receives_ahead, shared_parameters
from fxpar.ir import meta

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402

TOKENS, LABELS = global_batches()[0]


def run_stages(program: fxpar.Program, tokens, labels) -> torch.Tensor:
    """Chain the stage graphs by hand, as the pipeline does over ranks; the last stage divides
    the loss's sum by the batch's count of valid targets, as the runtime gives it."""
    count = program.loss_reduction.count_module(tokens, labels).to(torch.float32)
    inputs, carried = dict(zip(program.input_names, (tokens, labels, count))), ()
    for stage in program.stages:
        result = stage.graph_module(*carried, *(inputs[n] for n in stage.user_inputs))
        carried = result if isinstance(result, tuple) else (result,)
    return carried[0]


@pytest.mark.parametrize("model", ["gpt", "gpt2", "llama"])
@pytest.mark.parametrize("plan", ["pp=2 mb=2", "pp=3 mb=4", "pp=2 mb=4 schedule=interleaved virtual_stages=2"])
def test_stage_graphs_chained_compute_the_models_loss(model, plan):
    program = fxpar.compile(build_model(model), plan, (TOKENS, LABELS))
    expected = build_model(model)(TOKENS, LABELS)
    assert torch.equal(run_stages(program, TOKENS, LABELS), expected)
    program.check()


def test_boundaries_are_formulas_in_batch_and_seq():
    program = fxpar.compile(build_model("gpt"), "pp=2 mb=2", (TOKENS, LABELS))
    (boundary,) = program.stages[1].inputs
    batch, seq = program.captured.symbols["batch"], program.captured.symbols["seq"]
    assert tuple(program.captured.readable(d) for d in boundary.shape) == (batch, seq, 32)
    assert boundary.requires_grad and program.stages[0].inputs == ()
    assert "targets" in program.stages[1].user_inputs  # the loss's labels (and idx for its sizes)


def test_tied_embedding_and_head_live_on_the_first_and_last_stage():
    program = fxpar.compile(build_model("gpt"), "pp=2 mb=2", (TOKENS, LABELS))
    assert shared_parameters(program.stages) == {"wte.weight": (0, 1)}


def test_split_names_where_stages_begin():
    program = fxpar.compile(build_model("gpt"), fxpar.Plan(pp=2, microbatches=2, split=("h.1",)), (TOKENS, LABELS))
    computed = [  # ops the stage computes (shape arithmetic is recomputed everywhere)
        meta.module_path(n) for n in program.stages[1].graph_module.graph.nodes
        if n.meta.get(meta.STAGE) == 1
    ]
    assert computed[0].startswith("h.1") and all(not p.startswith("h.0") for p in computed)
    assert "h.1" in program.describe_stages()


def test_split_naming_no_module_is_a_plan_error():
    with pytest.raises(PlanError, match="split names module 'blocks.3', which no op of the model belongs to"):
        fxpar.compile(build_model("gpt"), fxpar.Plan(pp=2, microbatches=2, split=("blocks.3",)), (TOKENS, LABELS))


def test_more_stages_than_clean_cuts_is_a_plan_error():
    with pytest.raises(PlanError, match=r"clean cut points .between blocks., too few for 16 pipeline stages"):
        fxpar.compile(build_model("gpt"), "pp=16 mb=16", (torch.randint(0, 64, (16, 16)),) * 2)


def test_batch_not_divisible_by_microbatches_is_a_plan_error():
    with pytest.raises(PlanError, match="global batch 8 is not divisible by dp \\* microbatches = 1 \\* 3"):
        fxpar.compile(build_model("gpt"), "pp=2 mb=3", (TOKENS, LABELS))


def test_rank_modules_of_a_pipeline_are_its_stages():
    program = fxpar.compile(build_model("gpt"), "dp=2 pp=2 mb=4 schedule=interleaved virtual_stages=2", (TOKENS, LABELS))
    chunks = program.stage_modules(3)  # dp 1, pp 1: stages 1 and 3
    assert [meta.stage_of(m) for m in chunks] == [1, 3]
    assert meta.stage_of(program.rank_module(3)) == 1
    kinds = {c.kind for c in program.collectives(1)}
    assert {"send", "recv", "all_reduce"} <= kinds


def test_a_stage_holding_more_microbatches_gets_fewer_layers():
    """1F1B's first stage keeps p microbatches of activations: memory balance moves its cut."""
    from fxpar.frontend.trace import capture
    from fxpar.passes.infra import copy_graph_module
    from fxpar.passes.pipeline import assign_stages

    graph = capture(build_model("gpt"), (TOKENS, LABELS)).graph_module

    def first_stage_size(in_flight):
        gm = assign_stages(
            copy_graph_module(graph), stages=2, cost=lambda node: 0.0,
            memory=lambda node: (0.0, 1.0), in_flight=in_flight,
        )
        return sum(1 for n in gm.graph.nodes if n.meta.get(meta.STAGE) == 0)

    assert first_stage_size((8.0, 1.0)) < first_stage_size((1.0, 1.0))


def test_receives_are_posted_one_action_ahead_on_gloo_only():
    assert list(issue_order(3, 1)) == [
        ("receive", 0), ("receive", 1), ("run", 0), ("receive", 2), ("run", 1), ("run", 2),
    ]
    assert list(issue_order(2, 0)) == [("receive", 0), ("run", 0), ("receive", 1), ("run", 1)]
    assert (receives_ahead("gloo"), receives_ahead("nccl")) == (1, 0)
    program = fxpar.compile(build_model(), "pp=2 mb=4", example_inputs=global_batches()[0])
    # 1F1B's rank 0 runs F0 F1 B0 ...: on gloo it posts B0's receive before F1 sends; on NCCL,
    # where a pair's transfers share a stream, B0's receive waits for B0 (receives_ahead).
    gloo, nccl = program.collectives(0, backend="gloo"), program.collectives(0, backend="nccl")
    transfers = lambda calls: [c.kind for c in calls if c.kind in ("send", "recv")]  # noqa: E731
    assert transfers(gloo)[:3] == ["send", "recv", "send"]  # (after the step agreement's all-reduce)
    assert transfers(nccl)[:3] == ["send", "send", "recv"]
    assert sorted(map(repr, gloo)) == sorted(map(repr, nccl))  # the same calls, reordered
