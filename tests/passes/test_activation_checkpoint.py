"""Activation checkpointing at compile time: which nodes each mode marks, the errors for a
model it cannot checkpoint, and what the cost model makes of the marks."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sympy
import torch

import fxpar
from fxpar.cost.ops import cost_of
from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.recompute_regions import block_lists, block_of, segments
from fxpar.ops.distributed import distributed_op

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))
from explicit_attention import ExplicitAttentionGPT, Flat  # noqa: E402
from tiny_training import CONFIG, GPT, build_model, global_batches  # noqa: E402
from hf_models import build  # noqa: E402

BATCH = global_batches()[0]


def compile_model(model, plan: str):
    return fxpar.compile(model, plan, example_inputs=BATCH)


def marked(gm) -> dict[str, str]:
    return {n.name: meta.recompute_region(n) for n in gm.graph.nodes if meta.recompute_region(n)}


@pytest.mark.parametrize("model, lists", [("gpt", ("h",)), ("gpt2", ("transformer.h",)), ("llama", ("layers",))])
def test_block_lists_are_the_repeated_children_of_one_module(model, lists):
    program = compile_model(build_model(model), "checkpoint=full")
    assert block_lists(program.captured.graph_module.graph) == lists
    assert block_of(f"{lists[0]}.1.attn.q", lists) == f"{lists[0]}.1"
    assert block_of("ln_f", lists) is None


def test_full_marks_every_node_of_every_block_and_nothing_else():
    program = compile_model(build_model("gpt"), "checkpoint=full")
    gm = program.graph_module
    for node in gm.graph.nodes:
        in_block = node.op == "call_function" and meta.module_path(node).startswith("h.")
        assert (meta.recompute_region(node) == meta.module_path(node)[:3]) == in_block, node.format_node()
    assert [meta.recompute_region(run[0]) for run in segments(gm.graph.nodes, meta.recompute_region)] == ["h.0", "h.1"]
    assert "mark_recomputation(mode='full', blocks=('h',))" in str(program.passes)


def test_selective_marks_the_sdpa_call_or_the_explicit_core():
    sdpa = marked(compile_model(build_model("gpt"), "checkpoint=selective").graph_module)
    assert sdpa == {"scaled_dot_product_attention": "h.0.attn:core", "scaled_dot_product_attention_1": "h.1.attn:core"}
    # With dropout, SDPA is fxpar's masked attention and its mask's draw: both recomputed.
    torch.manual_seed(0)
    dropped = compile_model(GPT(replace(CONFIG, dropout=0.1)), "checkpoint=selective").graph_module
    assert sorted(n.target.__name__ for n in dropped.graph.nodes if meta.recompute_region(n) == "h.0.attn:core") == [
        "attention_dropout_mask.default", "attention_with_dropout_mask.default"]
    torch.manual_seed(0)
    gm = compile_model(ExplicitAttentionGPT(), "checkpoint=selective").graph_module
    core = [n.target for n in gm.graph.nodes if meta.recompute_region(n) == "blocks.0.attn:core"]
    aten = torch.ops.aten
    # Dropout is x * random_like(detach(x)) once fxpar draws it (`passes.random_draws`): the
    # draw is recomputed too, from the same stream seed (`fxpar.ops.random_streams`).
    assert core == [aten.matmul.default, aten.div.Tensor, aten.masked_fill.Scalar, aten.softmax.int,
                    aten.detach.default, torch.ops.fxpar.random_like.default, aten.mul.Tensor,
                    aten.matmul.default]
    # The mask's slicing runs outside the core and is skipped over: one recomputed call per core.
    assert len(segments(gm.graph.nodes, meta.recompute_region)) == 2


_SOFTMAX_TO_PV = ["softmax", "_assert_tensor_metadata", "to", "dropout"]  # export checks .to()'s dtype


@pytest.mark.parametrize("name, core", [
    ("gpt2", ["matmul", "mul", "add", *_SOFTMAX_TO_PV, "matmul"]),
    ("gemma2", ["matmul", "mul", "div", "tanh", "mul", "add", *_SOFTMAX_TO_PV, "matmul"]),  # soft-capped
    ("bloom", ["baddbmm", "reshape", "add", *_SOFTMAX_TO_PV, "reshape", "bmm"]),  # ALiBi's baddbmm
])
def test_selective_finds_the_explicit_core_of_hugging_face_eager_attention(name, core):
    """Transformers' eager attention: the scores' soft-capping, reshapes and export's dtype
    check are in the core, which ends at the matmul with V, once per layer."""
    model, inputs = build(name, "eager")
    gm = fxpar.compile(model, "checkpoint=selective", inputs).graph_module
    regions: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if region := meta.recompute_region(node):
            regions.setdefault(region, []).append(node.target.__name__.split(".")[0])
    assert len(regions) == 2 and all(ops == core for ops in regions.values()), regions


@pytest.mark.parametrize("plan", ["tp=2 checkpoint=full", "tp=2 sp=true checkpoint=full",
                                  "pp=2 mb=2 schedule=zb-h1 tp=2 checkpoint=full"])
def test_no_collective_of_a_forward_is_ever_recomputed(plan):
    """g (all-reduce) and sequence parallelism's all-gather/reduce-scatter stay outside every
    region; f (identity forward, all-reduce in backward) may be recomputed."""
    program = compile_model(build_model("gpt"), plan)
    graphs = [program.graph_module] if program.stages is None else [s.graph_module for s in program.stages]
    seen = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            if (op := distributed_op(node)) is not None:
                seen.add((op.name, meta.recompute_region(node) is not None))
                if op.forward in ("all_reduce", "all_gather", "reduce_scatter"):
                    assert meta.recompute_region(node) is None, node.format_node()
    assert ("copy_to_region", True) in seen or ("gather_to_region", False) in seen


def test_full_on_a_model_without_blocks_is_a_plan_error():
    with pytest.raises(PlanError, match="no block list.*nn.ModuleList") as error:
        compile_model(Flat(), "checkpoint=full")
    assert error.value.field == "checkpoint"
    with pytest.raises(PlanError, match="selective recomputes attention's core.*has none"):
        compile_model(Flat(), "checkpoint=selective")
    compile_model(Flat(), "checkpoint=none").check()


def test_under_zero3_a_block_is_one_region_and_the_gathers_are_in_none():
    """ZeRO-3's gathers communicate and its regathers' backwards do: neither is recomputed.
    The regather wraps the block's output (`passes.zero3`), so each block is still one
    checkpoint call, whose recomputation reads the weights the regather's backward gathers."""
    gather, regather = torch.ops.fxpar.gather_parameters.default, torch.ops.fxpar.regather_parameters.default
    for reshard in ("true", "false"):
        program = compile_model(build_model("gpt"), f"dp=2 zero=3 checkpoint=full reshard_after_forward={reshard}")
        program.check()
        graph = program.rank_module(0).graph
        zero3 = [n for n in graph.nodes if n.target in (gather, regather)]
        assert zero3 and all(meta.recompute_region(n) is None for n in zero3)
        runs = segments(graph.nodes, meta.recompute_region)
        assert [meta.recompute_region(run[0]) for run in runs] == ["h.0", "h.1"], reshard


def test_the_estimate_keeps_block_inputs_under_full_and_drops_the_attention_core_under_selective():
    torch.manual_seed(0)
    estimates = {mode: compile_model(ExplicitAttentionGPT(), f"checkpoint={mode}").estimate("h100")
                 for mode in ("none", "full", "selective")}
    saved = {mode: e.memory["activations"] for mode, e in estimates.items()}
    b, s, h, heads, layers = 8, 16, 32, 4, 2
    # Selective drops, per layer, the three s x s fp32 tensors the core saves: the softmax's
    # output (its backward's and the dropout product's), the drawn mask (dropout is x * mask,
    # the mask fp32) and the dropout's output (the PV matmul's). q, k, v are projection
    # outputs: kept.
    assert saved["none"] - saved["selective"] == layers * b * heads * s * s * 4 * 3
    # Full keeps each block's input (b s h fp32) in place of everything the blocks save.
    outside = compile_model(ExplicitAttentionGPT(), "checkpoint=full").estimate("h100").memory["activations"]
    assert saved["full"] == outside < saved["selective"] < saved["none"]
    assert saved["full"] > layers * b * s * h * 4
    # Recompute: one more forward of the blocks (full), of the cores (selective); not model FLOPs.
    program = compile_model(ExplicitAttentionGPT(), "checkpoint=full")
    blocks = sum(
        (c.matmul_flops + c.other_flops for n in program.captured.graph_module.graph.nodes
         if n.op == "call_function" and meta.module_path(n).startswith("blocks.")
         and (c := cost_of(n, program.captured.shape)) is not None),
        sympy.Integer(0),
    )
    assert estimates["full"].flops["recompute"] == pytest.approx(float(blocks.subs(program.captured.example_sizes)))
    assert 0 < estimates["selective"].flops["recompute"] < estimates["full"].flops["recompute"]
    assert estimates["none"].flops["recompute"] == 0
    for mode in ("full", "selective"):
        e = estimates[mode]
        assert e.flops["total"] == estimates["none"].flops["total"]
        assert e.time["recompute"] > 0
        assert e.time["total"] == pytest.approx(e.time["compute"] + e.time["recompute"] + e.time["optimizer"]
                                                + e.time["comm_exposed"] + e.time["bubble"])
