"""Tier 1: tensor-parallel rules, rewrites and errors on small graphs, no processes."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxpar
from fxpar import PlanError, meta
from fxpar.passes.tp_rules import infer_styles
from fxpar.placement import R, Shard, global_tensor, local_slice
from fxpar.trace import capture

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402

TOKENS, LABELS = global_batches()[0]


def placements(program: fxpar.Program) -> dict[str, object]:
    nodes = meta.parameter_nodes(program.graph_module.graph)
    return {name: meta.placement(node) for name, node in nodes.items()}


def test_auto_infers_megatron_pairs_on_gpt():
    styles = infer_styles(capture(build_model("gpt"), (TOKENS, LABELS)).graph_module)
    assert {m: s for m, s in styles.items() if m.startswith("h.0.")} == {
        "h.0.attn.q": "colwise", "h.0.attn.k": "colwise", "h.0.attn.v": "colwise",
        "h.0.attn.o": "rowwise", "h.0.mlp.up": "colwise", "h.0.mlp.down": "rowwise",
    }
    assert styles["wte"] == "vocab" and "wpe" not in styles  # positions are not token ids


def test_auto_infers_swiglu_and_the_untied_head_on_llama():
    styles = infer_styles(capture(build_model("llama"), (TOKENS, LABELS)).graph_module)
    assert {m: s for m, s in styles.items() if m.startswith("layers.1.")} == {
        "layers.1.attention.q_proj": "colwise", "layers.1.attention.k_proj": "colwise",
        "layers.1.attention.v_proj": "colwise", "layers.1.attention.o_proj": "rowwise",
        "layers.1.mlp.gate_proj": "colwise", "layers.1.mlp.up_proj": "colwise",
        "layers.1.mlp.down_proj": "rowwise",
    }
    assert styles["embed_tokens"] == "vocab" and styles["lm_head"] == "vocab"


def test_a_hugging_face_tp_plan_is_accepted_as_is():
    hf_plan = {  # transformers' LlamaConfig.base_model_tp_plan, with this model's module names
        "layers.*.attention.q_proj": "colwise", "layers.*.attention.k_proj": "colwise",
        "layers.*.attention.v_proj": "colwise", "layers.*.attention.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise", "embed_tokens": "rowwise", "lm_head": "colwise_rep",
    }
    program = fxpar.compile(build_model("llama"), fxpar.Plan(tp=2, tp_rules=hf_plan), (TOKENS, LABELS))
    found = placements(program)
    assert found["layers.0.attention.q_proj.weight"] == Shard(0)
    assert found["layers.0.mlp.down_proj.weight"] == Shard(1)
    assert found["embed_tokens.weight"] == Shard(0)  # an embedding's rowwise splits the vocabulary
    assert found["layers.0.attention_norm.weight"] == R


def test_rank_module_holds_local_shards_and_local_head_counts():
    program = fxpar.compile(build_model("gpt"), "dp=2 tp=2", (TOKENS, LABELS))
    module = program.rank_module(3)
    assert module.tp_group.ranks == (2, 3) and module.tp_group.index == 1
    assert module.get_parameter("h.0.attn.q.weight").shape == (16, 32)
    assert module.get_parameter("h.0.attn.o.weight").shape == (32, 16)
    assert "[sym_size_int_4, sym_size_int_5, 2, 8]" in module.code  # 4 heads -> 2 per rank
    assert "copy_to_region" in module.code and "vocab_parallel_cross_entropy" in module.code
    program.check()


def test_fused_qkv_weight_is_laid_out_so_each_rank_holds_its_own_heads():
    program = fxpar.compile(build_model("gpt2"), "tp=2", (TOKENS, LABELS))
    assert placements(program)["transformer.h.0.attn.c_attn.weight"] == Shard(0, parts=3)
    whole = build_model("gpt2").transformer.h[0].attn.c_attn.weight.detach()
    piece = program.rank_module(1).get_parameter("transformer.h.0.attn.c_attn.weight")
    q, k, v = whole.split(32)
    assert torch.equal(piece, torch.cat([q[16:], k[16:], v[16:]]))
    pieces = [program.rank_module(r).get_parameter("transformer.h.0.attn.c_attn.weight") for r in (0, 1)]
    assert torch.equal(global_tensor(pieces, Shard(0, parts=3)), whole)


def test_local_slice_and_global_tensor_are_inverse():
    x = torch.arange(24.0).reshape(6, 4)
    for placement in (Shard(0), Shard(1), Shard(0, parts=3)):
        size = 2
        assert torch.equal(global_tensor([local_slice(x, placement, i, size) for i in range(size)], placement), x)


def test_kv_heads_not_divisible_by_tp_is_a_plan_error():
    with pytest.raises(PlanError, match="not divisible by tp=8 .for grouped-query attention"):
        fxpar.compile(build_model("llama"), "tp=8", (TOKENS, LABELS))


def test_rules_matching_nothing_or_naming_no_style_are_plan_errors():
    with pytest.raises(PlanError, match=r"tp_rules\['blocks\.\*\.q'\] matches no module"):
        fxpar.compile(build_model("gpt"), fxpar.Plan(tp=2, tp_rules={"blocks.*.q": "colwise"}), (TOKENS, LABELS))
    with pytest.raises(PlanError, match="'diagonal' is not a tensor-parallel style"):
        fxpar.compile(build_model("gpt"), fxpar.Plan(tp=2, tp_rules={"h.*.attn.q": "diagonal"}), (TOKENS, LABELS))


class _Cumulative(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.down(torch.cumsum(self.up(x), dim=-1)), y)


def test_an_op_without_a_rule_on_a_shard_names_node_module_and_fix():
    x = torch.randn(4, 8)
    plan = fxpar.Plan(tp=2, tp_rules={"up": "colwise", "down": "rowwise"})
    with pytest.raises(PlanError) as error:
        fxpar.compile(_Cumulative(), plan, (x, x))
    message = str(error.value)
    assert "no placement rule for op aten.cumsum.default" in message
    assert "(module '<root module>')" in message and "linear: S(1)" in message
    assert "tp_propagation.RULES" in message


def test_tp_collectives_are_predicted_per_microbatch():
    program = fxpar.compile(build_model("gpt"), "tp=2 mb=2", (TOKENS, LABELS))
    one = fxpar.compile(build_model("gpt"), "tp=2", (TOKENS, LABELS))
    assert len(program.collectives(0)) == 2 * len(one.collectives(0))
    # half the batch per microbatch: half the payload per call
    assert sum(c.numel for c in program.collectives(0)) == sum(c.numel for c in one.collectives(0))
