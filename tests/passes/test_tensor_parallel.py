"""Tier 1: tensor-parallel rules, rewrites and errors on small graphs, no processes."""

import dataclasses
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from fxpar import PlanError
import fxpar
from fxpar.frontend.trace import capture
from fxpar.ir import meta
from fxpar.ir.axes import bind_axes, unbind_axes
from fxpar.ir.mesh import Axis
from fxpar.ir.placement import Placements, R, Shard, global_tensor, local_slice
from fxpar.passes.tensor_parallel.rules import infer_styles, placement_for

ops = SimpleNamespace(**{  # the ops the passes insert, as graph targets
    name: getattr(torch.ops.fxpar, name).default
    for name in ("all_reduce", "all_gather", "vocab_parallel_embedding")
})
sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402

TOKENS, LABELS = global_batches()[0]



def layer_collectives(program: fxpar.Program) -> list:
    """Rank 0's collectives of the model's own ops: what the layers and the loss move, without
    the step agreement (`lowering.step_start_actions`), its own call or the slots it rides in
    (`lowering.ride_agreements`)."""
    return [dataclasses.replace(c, numel=c.numel - c.agreement, agreement=0)  # slots riding in a call
            for c in program.collectives(0) if not c.tag.startswith("step agreement")]


def placements(program: fxpar.Program) -> dict[str, object]:
    nodes = meta.parameter_nodes(program.graph_module.graph)
    return {name: meta.placement(node, "tp") for name, node in nodes.items()}


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
    assert not hasattr(module, "tp_group")  # no runtime object: the ops name their axis
    assert program.mesh.group(3, Axis.TP) == (2, 3) and program.mesh.coord(3).tp == 1
    assert module.get_parameter("h.0.attn.q.weight").shape == (16, 32)
    assert module.get_parameter("h.0.attn.o.weight").shape == (32, 16)
    assert "[sym_size_int_4, sym_size_int_5, 2, 8]" in module.code  # 4 heads -> 2 per rank
    assert "fxpar.copy_to_region.default(" in module.code and "'tp')" in module.code
    assert "fxpar.all_reduce_max.default(" in module.code  # the vocabulary-parallel loss
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
        pieces = [local_slice(x, Placements(tp=placement), {"tp": i}, {"tp": size}) for i in range(size)]
        assert torch.equal(global_tensor(pieces, placement), x)


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
    # The fix is the user's to apply: the modules that split the op's inputs, kept whole.
    assert "split in modules 'up'" in message
    assert "{'up': 'replicate'}" in message and "RULES" not in message


def test_tp_collectives_are_predicted_per_microbatch():
    program = fxpar.compile(build_model("gpt"), "tp=2 mb=2", (TOKENS, LABELS))
    one = fxpar.compile(build_model("gpt"), "tp=2", (TOKENS, LABELS))
    assert len(layer_collectives(program)) == 2 * len(layer_collectives(one))
    # half the batch per microbatch: half the payload per call
    assert sum(c.numel for c in layer_collectives(program)) == sum(c.numel for c in layer_collectives(one))


# -- placements of every projection form and style ---------------------------------------------


@pytest.mark.parametrize("kind, role, style, parts, placement", [
    ("linear", "weight", "colwise", 1, Shard(0)),  # nn.Linear's weight is (out, in)
    ("linear", "weight", "rowwise", 1, Shard(1)),
    ("linear", "bias", "rowwise", 1, R),  # added once, after the sum
    ("matmul", "weight", "colwise", 1, Shard(1)),  # GPT-2's Conv1D weight is (in, out)
    ("matmul", "weight", "rowwise", 1, Shard(0)),
    ("matmul", "bias", "colwise", 3, Shard(0, parts=3)),  # a fused q|k|v bias
    ("matmul", "weight", "colwise", 3, Shard(1, parts=3)),
    ("linear", "weight", "packed_colwise", 1, Shard(0, parts=2)),  # gate|up
    ("linear", "weight", "colwise_gather_output", 1, Shard(0)),
    ("linear", "weight", "vocab", 1, Shard(0)),
    ("embedding", "weight", "vocab", 1, Shard(0)),
    ("embedding", "weight", "rowwise", 1, Shard(0)),  # Hugging Face's embedding rowwise
    ("embedding", "weight", "colwise", 1, Shard(1)),
    ("other", "other", "colwise", 1, R),
])
def test_placement_for_each_form_and_style(kind, role, style, parts, placement):
    assert placement_for(kind, role, style, parts=parts) == placement


def test_vocab_parallel_embedding_keeps_the_padding_row_gradient_zero():
    torch.manual_seed(0)
    whole = torch.randn(8, 3)
    ids = torch.tensor([[0, 6, 5, 6], [1, 7, 6, 2]])
    expected = nn.functional.embedding(ids, whole, padding_idx=6)
    pieces, grads = [], []
    for index in range(2):  # rank 1 holds rows 4..7, the padding row among them as its row 2
        shard = whole.chunk(2)[index].clone().requires_grad_()
        bind_axes({"tp": SimpleNamespace(index=index, size=2)})
        try:
            out = torch.ops.fxpar.vocab_parallel_embedding(shard, ids, "tp", 6)
            out.sum().backward()
        finally:
            unbind_axes()
        pieces.append(out.detach())
        grads.append(shard.grad)
    assert torch.equal(pieces[0] + pieces[1], expected)
    global_grad = torch.cat(grads)
    assert torch.equal(global_grad[6], torch.zeros(3))
    assert torch.equal(global_grad[5], torch.ones(3)) and torch.equal(global_grad[7], torch.ones(3))


class _Lookup(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.emb = nn.Embedding(64, 16, **options)
        self.head = nn.Linear(16, 64)

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), labels.flatten())


def test_the_padding_index_reaches_the_vocabulary_parallel_embedding():
    program = fxpar.compile(_Lookup(padding_idx=3), "tp=2", (TOKENS, LABELS))
    graph = program.rank_module(1).graph
    lookup = next(n for n in graph.nodes if n.target is ops.vocab_parallel_embedding)
    weight, ids, axis, padding_idx = lookup.args
    assert axis == "tp" and padding_idx == 3


@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
def test_embedding_options_a_vocabulary_shard_cannot_honour_are_plan_errors(option):
    with pytest.raises(PlanError, match=rf"{option}=True.*module 'emb'.*tp_rules=\{{'emb': 'replicate'\}}"):
        fxpar.compile(_Lookup(**{option: True}), "tp=2", (TOKENS, LABELS))
    fxpar.compile(_Lookup(**{option: True}), fxpar.Plan(tp=2, tp_rules={"head": "vocab"}), (TOKENS, LABELS))


def test_the_vocabulary_parallel_embedding_is_summed_where_it_is_produced():
    program = fxpar.compile(build_model("llama"), "tp=2", (TOKENS, LABELS))
    graph = program.rank_module(0).graph
    lookup = next(n for n in graph.nodes if n.target is ops.vocab_parallel_embedding)
    assert [u.target for u in lookup.users] == [ops.all_reduce] and lookup.next.target is ops.all_reduce
    # so the residual stream is replicated: 2 all-reduces per layer, 1 for the embedding and
    # the loss' 2 forward; f before each column-parallel group and the head backward
    layers = 2
    calls = Counter((c.kind, c.phase) for c in layer_collectives(program))
    assert calls == {
        ("all_reduce", "forward"): 2 * layers + 1 + 2, ("all_reduce", "backward"): 2 * layers + 1,
    }


def test_gathering_styles_gather_right_where_the_output_is_produced():
    rules = {"layers.*.attention.[qkv]_proj": "colwise", "layers.*.attention.o_proj": "rowwise",
             "lm_head": "colwise_gather_output", "embed_tokens": "embedding_colwise"}
    program = fxpar.compile(build_model("llama"), fxpar.Plan(tp=2, tp_rules=rules), (TOKENS, LABELS))
    graph = program.rank_module(0).graph
    aten = torch.ops.aten
    for module, op in (("lm_head", aten.linear.default), ("embed_tokens", aten.embedding.default)):
        node = next(n for n in graph.nodes if meta.module_path(n) == module and n.target is op)
        assert node.next.target is ops.all_gather and [u.target for u in node.users] == [ops.all_gather]
    assert placements(program)["embed_tokens.weight"] == Shard(1)  # the embedding dim is split
    assert "all_reduce_max" not in program.rank_module(0).code  # the logits are whole: no vocab-parallel loss


class _PackedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(8, 32)
        self.down = nn.Linear(16, 8)

    def forward(self, x, y):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return nn.functional.mse_loss(self.down(nn.functional.silu(gate) * up), y)


@pytest.mark.parametrize("style", ["packed_colwise", "colwise"])
def test_a_packed_projection_gives_each_rank_its_slice_of_each_block(style):
    x = torch.randn(4, 8)
    plan = fxpar.Plan(tp=2, tp_rules={"gate_up": style, "down": "rowwise"})
    found = placements(fxpar.compile(_PackedMLP(), plan, (x, x)))
    assert found["gate_up.weight"] == Shard(0, parts=2) and found["gate_up.bias"] == Shard(0, parts=2)


# -- rules fxpar cannot honour -----------------------------------------------------------------


def test_an_expert_parallel_style_is_a_plan_error_with_a_fix():
    plan = fxpar.Plan(tp=2, tp_rules={"layers.*.mlp": "moe_tp_experts"})
    with pytest.raises(PlanError, match=r"mixture-of-experts.*Fix: .*\['layers\.\*\.mlp'\] = 'replicate'"):
        fxpar.compile(build_model("llama"), plan, (TOKENS, LABELS))


def test_a_rule_naming_a_module_whose_parameters_cannot_be_split_is_a_plan_error():
    plan = fxpar.Plan(tp=2, tp_rules={"layers.*.attention_norm": "colwise"})
    message = r"module 'layers\.0\.attention_norm' colwise.*cannot split its parameter"
    with pytest.raises(PlanError, match=message):
        fxpar.compile(build_model("llama"), plan, (TOKENS, LABELS))


def test_a_tied_weight_whose_uses_want_different_layouts_is_a_plan_error():
    plan = fxpar.Plan(tp=2, tp_rules={"wte": "colwise"})  # the embedding splits its dim, the head its vocab
    message = r"'wte.weight' is used in ways whose tensor-parallel layouts disagree"
    with pytest.raises(PlanError, match=message):
        fxpar.compile(build_model("gpt"), plan, (TOKENS, LABELS))
