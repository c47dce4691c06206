"""Tier 1: tensor parallelism on projections the graph cuts into blocks, and interleaved rotary.

A fused projection (GPT-NeoX's packed q|k|v, Phi-3's gate|up chunked in two and its
grouped-query q|k|v sliced unevenly) is `Shard(0, parts)`: each rank holds its slice of each
block. Its blocks come apart locally (chunk, split, a slice taking one block) or are gathered
whole (viewed apart and all-gathered; unequal blocks one by one). GPT-J and Cohere rotate
interleaved pairs, stacking head shards. The rank modules run as threads
(`tp_threads`), held to one device per gradient.
"""

import sys
from collections import Counter
from pathlib import Path

import pytest

import fxpar
from fxpar.ir import meta
from fxpar.ir.placement import Shard

sys.path.insert(0, str(Path(__file__).parent))
from tp_threads import LAYERS, assert_equals_one_device, captured, compiled, kinds, layer_collectives  # noqa: E402


def test_packed_colwise_on_gpt_neox_head_major_qkv_is_gathered_whole_and_exact():
    """q|k|v interleave per head: no two-block packing splits the heads, so the packed output
    is gathered (blocks viewed apart, all-gathered, joined) before the view that cuts heads."""
    model, inputs, graph = captured("gpt_neox")
    plan = fxpar.Plan(tp=2, tp_rules={"layers.*.attention.query_key_value": "packed_colwise"})
    program = fxpar.compile(graph, plan)
    qkv = inputs[0].numel() * 3 * 64
    assert kinds(program)["all_gather", "forward"] == LAYERS
    assert ("all_gather", "forward", qkv) in [(c.kind, c.phase, c.numel) for c in layer_collectives(program)]
    assert_equals_one_device(program, model, inputs)


# -- 4b. fused projections split by the graph, interleaved rotary ------------------------------


def test_phi3_plan_gathers_its_fused_projections_whole_and_equals_one_device():
    """Phi-3's own plan: qkv_proj and gate_up_proj colwise_gather_output, o_proj and down_proj
    rowwise_split_input. The graph chunks gate|up, so each rank holds its slice of both blocks
    (S(0, parts=2)), gathered by viewing the blocks apart, all-gathering and joining them; it
    slices q|k|v unevenly (4 query heads, 2 key, 2 value: S(0, parts=2:1:1)), gathered block
    by block and concatenated."""
    model, inputs, program = compiled("phi3", "tp=2")
    weights = meta.parameter_nodes(program.graph_module.graph)
    assert meta.placement(weights["model.model.layers.0.mlp.gate_up_proj.weight"], "tp") == Shard(0, 2)
    assert meta.placement(weights["model.model.layers.0.self_attn.qkv_proj.weight"], "tp") == Shard(0, (2, 1, 1))
    tokens = inputs[0].numel()
    calls = Counter((c.kind, c.phase, c.numel) for c in layer_collectives(program))
    assert calls["all_gather", "forward", tokens * 2 * 128] == LAYERS  # gate|up, whole
    assert calls["all_gather", "forward", tokens * 64] == LAYERS  # q
    assert calls["all_gather", "forward", tokens * 32] == 2 * LAYERS  # k and v
    assert_equals_one_device(program, model, inputs)


def test_phi3_inferred_plan_is_megatrons_on_its_fused_projections_and_equals_one_device():
    """Megatron's layout: each rank holds its slice of each of the fused blocks; chunk(2)
    takes its own gate and up slices (the count of chunks stays 2), each slice of q|k|v takes
    its own q, k or v heads (the bounds made local), and nothing is gathered in a layer: two
    all-reduces forward and two backward, as for Llama."""
    model, inputs, program = compiled("phi3", "tp=2 tp_rules=infer")
    weights = meta.parameter_nodes(program.graph_module.graph)
    assert meta.placement(weights["model.model.layers.0.self_attn.qkv_proj.weight"], "tp") == Shard(0, (2, 1, 1))
    stream = inputs[0].numel() * 64
    calls = Counter((c.kind, c.phase, c.numel) for c in layer_collectives(program))
    assert kinds(program)["all_gather", "forward"] == 0
    assert calls["all_reduce", "forward", stream] == 1 + 2 * LAYERS  # the embedding's sum, then g
    assert_equals_one_device(program, model, inputs)


@pytest.mark.parametrize(("name", "rules"), [("gptj", "auto"), ("cohere", "auto"), ("cohere", "infer")])
def test_interleaved_rotary_stacks_head_shards_and_equals_one_device(name, rules):
    """GPT-J and Cohere rotate every pair: stack((-x2, x1), dim=-1) of values split by heads
    stays split by heads; q, k and v stay column-parallel and nothing is gathered."""
    model, inputs, program = compiled(name, f"tp=2 tp_rules={rules}")
    q = next(node for n, node in meta.parameter_nodes(program.graph_module.graph).items()
             if n.endswith("layers.0.self_attn.q_proj.weight") or n.endswith("h.0.attn.q_proj.weight"))
    assert meta.placement(q, "tp") == Shard(0)
    assert kinds(program)["all_gather", "forward"] == 0
    assert_equals_one_device(program, model, inputs)
