"""Tier 1: tensor parallelism on unmodified Hugging Face models, and on every projection form.

Models come from tests/hf_models.py (small configs, random weights, nothing downloaded; GPT-2's
Conv1D, Llama's and Mistral's grouped-query attention, Qwen2's q/k/v biases, GPT-NeoX's fused
query_key_value, BERT's pad token), with sdpa and eager attention (fused projections the
graph cuts into blocks: test_tp_fused_projections.py). Three kinds of check:

* styles: inference (`tp_rules="infer"`, and `"auto"` for a model without a plan of its own)
  finds Megatron's layout, equal to the model's own `base_model_tp_plan` where it has one;
* counts: `program.collectives(rank)` holds Megatron's collectives, exactly (Shoeybi et al.
  2019, Sec. 3: two all-reduces forward and two backward per layer);
* numbers: the rank modules run as threads of this process, their collectives meeting in
  `tp_threads.ThreadedCollectives` (no process group, no torchrun), and their loss and every gradient,
  reassembled from the shards, equal one device's. fp32, relative 1e-4 and absolute 1e-6:
  sharding sums the same products in another order, nothing more.
"""

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.frontend.trace import capture
from fxpar.ir import meta
from fxpar.ir.placement import R, Shard
from fxpar.passes.tensor_parallel.rules import HF_STYLES, UNSUPPORTED_HF_STYLES, infer_styles
from fxpar.plan.declared import declared_plans

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from hf_models import MODELS_WITH_TP_PLAN, LossOf, build  # noqa: E402
from tp_threads import (  # noqa: E402
    LAYERS, assert_equals_one_device, captured, compiled, kinds, layer_collectives,
)

MODELS = ["gpt2", "llama", "mistral", "qwen2", "gpt_neox", "bert"]
# Megatron's layout for the models without a tp plan of their own.
MEGATRON = {
    "gpt2": {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
             "mlp.c_proj": "rowwise"},
    "bert": {"attention.self.query": "colwise", "attention.self.key": "colwise",
             "attention.self.value": "colwise", "attention.output.dense": "rowwise",
             "intermediate.dense": "colwise", "output.dense": "rowwise"},
}


# -- 1. every linear form ----------------------------------------------------------------------


def test_gpt2_conv1d_is_split_by_megatrons_rules_and_equals_one_device():
    rules = {f"h.*.{module}": style for module, style in MEGATRON["gpt2"].items()}
    model, inputs, program = compiled("gpt2", fxpar.Plan(tp=2, tp_rules=rules))
    found = {n: meta.placement(node, "tp") for n, node in meta.parameter_nodes(program.graph_module.graph).items()}
    layer = "model.transformer.h.0"
    # Conv1D's weight is (in, out): colwise splits dim 1, and c_attn's q|k|v blocks each
    assert found[f"{layer}.attn.c_attn.weight"] == Shard(1, parts=3)
    assert found[f"{layer}.attn.c_attn.bias"] == Shard(0, parts=3)
    assert found[f"{layer}.attn.c_proj.weight"] == Shard(0) and found[f"{layer}.attn.c_proj.bias"] == R
    assert found[f"{layer}.mlp.c_fc.weight"] == Shard(1) and found[f"{layer}.mlp.c_fc.bias"] == Shard(0)
    assert found[f"{layer}.mlp.c_proj.weight"] == Shard(0)
    rank = program.rank_module(0)
    whole = dict(model.named_parameters())
    for name, placement in found.items():
        if isinstance(placement, Shard):
            halved = list(whole[name].shape)
            halved[placement.dim] //= 2
            assert list(rank.get_parameter(name).shape) == halved, name
    assert "torch.ops.aten.mm.default" in rank.code  # row-parallel: addmm without its bias
    # Shoeybi et al. 2019, Sec. 3: two all-reduces forward and two backward per layer, no more.
    assert kinds(program) == {("all_reduce", "forward"): 2 * LAYERS, ("all_reduce", "backward"): 2 * LAYERS}
    assert_equals_one_device(program, model, inputs)


class Conv1D(nn.Module):
    """Hugging Face GPT-2's projection: weight (in, out), addmm(bias, x.view(-1, in), weight)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) / 10)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class MatrixProduct(nn.Module):
    """`x @ W` with W (in, out), as mm on a flattened input or as matmul."""

    def __init__(self, n_in: int, n_out: int, *, flatten: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.flatten = flatten

    def forward(self, x):
        if self.flatten:
            return torch.mm(x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        return x @ self.weight


class Forms(nn.Module):
    """Two MLPs whose projections take the four forms: addmm, mm, matmul and linear."""

    def __init__(self):
        super().__init__()
        self.up = Conv1D(8, 32)
        self.down = MatrixProduct(32, 8, flatten=True)
        self.up2 = MatrixProduct(8, 32, flatten=False)
        self.down2 = nn.Linear(32, 8)

    def forward(self, x, y):
        x = x + self.down(F.gelu(self.up(x)))
        x = x + self.down2(F.relu(self.up2(x)))
        return F.mse_loss(x, y)


def test_addmm_mm_and_matmul_projections_are_inferred_placed_and_exact():
    torch.manual_seed(0)
    model, inputs = Forms(), (torch.randn(4, 6, 8), torch.randn(4, 6, 8))
    assert infer_styles(capture(model, inputs).graph_module) == {
        "up": "colwise", "down": "rowwise", "up2": "colwise", "down2": "rowwise",
    }
    program = fxpar.compile(model, "tp=2", inputs)
    found = {n: meta.placement(node, "tp") for n, node in meta.parameter_nodes(program.graph_module.graph).items()}
    assert found == {
        "up.weight": Shard(1), "up.bias": Shard(0), "down.weight": Shard(0),
        "up2.weight": Shard(1), "down2.weight": Shard(1), "down2.bias": R,
    }
    # the input needs no gradient, so the first f is free in backward
    assert kinds(program) == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 1}
    assert_equals_one_device(program, model, inputs)


# -- 2. automatic styles follow data paths -----------------------------------------------------


def _expected_layer_styles(name: str, model: nn.Module) -> dict[str, str]:
    """{module-path glob: style} of the layers' projections: the model's plan, else Megatron's."""
    hf = model.model
    if name in MEGATRON:
        return {f"*.{module}": style for module, style in MEGATRON[name].items()}
    plan = hf.config.base_model_tp_plan
    return {f"*.{key}": style for key, style in plan.items() if key.startswith("layers.")}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_auto_styles_of_the_layers_equal_the_models_own_plan(name, attention):
    import fnmatch

    model, _, graph = captured(name, attention)
    styles = infer_styles(graph.graph_module)
    expected = _expected_layer_styles(name, model)
    layer_modules = [m for m in styles if any(fnmatch.fnmatchcase(m, g) for g in expected)]
    assert len(layer_modules) == len(expected) * LAYERS
    for module in layer_modules:
        wanted = next(s for g, s in expected.items() if fnmatch.fnmatchcase(module, g))
        assert styles[module] == wanted, module
    layer_styles = {m: s for m, s in styles.items() if ".0." in m or ".1." in m}
    assert set(layer_styles) == set(layer_modules)  # nothing else in the layers is split


# -- 3. the residual stream stays replicated ---------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_auto_moves_exactly_the_collectives_of_the_models_plan_or_megatrons(name, attention):
    """Per step at tp=2: with a plan of its own, `auto` is that plan, 2 all-reduces forward
    and 2 backward per layer of the residual stream (B x T x hidden), and what the plan says of
    the embedding; and on
    every model, sdpa or eager, the inferred layout is Megatron's: those, plus the
    vocabulary-parallel embedding's sum, the loss's two reductions (max; target logit and sum
    of exponentials, per token) and the f before the vocabulary-parallel head."""
    model, inputs, graph = captured(name, attention)
    stream, tokens = inputs[0].numel() * 64, inputs[0].numel()
    layers = [("all_reduce", "forward", stream)] * 2 * LAYERS, [("all_reduce", "backward", stream)] * 2 * LAYERS
    megatron = (
        [("all_reduce", "forward", stream)] + layers[0]
        + [("all_reduce", "forward", tokens), ("all_reduce", "forward", 2 * tokens)]
        + [("all_reduce", "backward", stream)] + layers[1]
    )
    calls = lambda plan: [(c.kind, c.phase, c.numel) for c in layer_collectives(fxpar.compile(graph, plan))]  # noqa: E731
    assert calls("tp=2 tp_rules=infer") == megatron
    # GPT-NeoX's own base plan also splits its embedding (embed_in: embedding_rowwise).
    embedding = [("all_reduce", "forward", stream)] if name == "gpt_neox" else []
    own = embedding + layers[0] + layers[1]
    assert calls("tp=2") == (own if name in MODELS_WITH_TP_PLAN else megatron)


def test_llama_auto_plan_is_its_base_model_plan():
    """`auto` takes the model's own base_model_tp_plan: the layers split, embedding and head
    replicated; 2 all-reduces forward and 2 backward per layer, nothing else."""
    model, inputs, program = compiled("llama", "tp=2")
    stream = inputs[0].numel() * 64
    calls = layer_collectives(program)
    assert [(c.kind, c.phase, c.numel) for c in calls] == (
        [("all_reduce", "forward", stream)] * 2 * LAYERS + [("all_reduce", "backward", stream)] * 2 * LAYERS
    )
    assert sum(c.payload_bytes for c in calls) == 262_144
    assert_equals_one_device(program, model, inputs)


def test_llama_inferred_plan_runs_megatrons_collectives_exactly():
    model, inputs, program = compiled("llama", "tp=2 tp_rules=infer")
    (batch, seq), hidden = inputs[0].shape, 64
    stream, tokens = batch * seq * hidden, batch * seq
    expected = (
        [("all_reduce", "forward", stream)]  # the vocabulary-parallel embedding, summed at once
        + [("all_reduce", "forward", stream)] * 2 * LAYERS  # g after attention and MLP
        + [("all_reduce", "forward", tokens), ("all_reduce", "forward", 2 * tokens)]  # the loss
        + [("all_reduce", "backward", stream)]  # f before the vocabulary-parallel head
        + [("all_reduce", "backward", stream)] * 2 * LAYERS  # f before attention and MLP
    )
    calls = layer_collectives(program)
    assert [(c.kind, c.phase, c.numel) for c in calls] == expected
    assert sum(c.payload_bytes for c in calls) == 329_216 == 4 * (10 * stream + 3 * tokens)
    code = program.rank_module(0).code
    assert "fxpar.vocab_parallel_embedding" in code and "fxpar.all_reduce_max" in code  # the vocab-parallel loss
    program.check()
    assert_equals_one_device(program, model, inputs)


def test_under_sequence_parallelism_the_embedding_is_reduce_scattered_and_exact():
    model, inputs, program = compiled("llama", "tp=2 sp=true tp_rules=infer")
    graph = program.rank_module(0).graph
    lookup = next(n for n in graph.nodes if n.target is torch.ops.fxpar.vocab_parallel_embedding.default)
    assert [u.target for u in lookup.users] == [torch.ops.fxpar.reduce_scatter.default]  # onto sequence shards
    assert_equals_one_device(program, model, inputs)


# -- 4. the models' own plans ------------------------------------------------------------------


def test_declared_plans_read_base_and_model_plans_relative_to_the_model():
    llama, _ = build("llama")
    plans = declared_plans(llama)
    rules = plans.whole
    assert rules["model.lm_head"] == "colwise_gather_output"  # LlamaForCausalLM._tp_plan
    assert rules["model.model.layers.*.self_attn.q_proj"] == "colwise"  # base_model_tp_plan
    assert rules["model.model.embed_tokens"] == "embedding_rowwise"  # transformers adds it
    assert set(plans.base) == {k for k in rules if ".layers." in k}  # the layers alone
    assert declared_plans(llama.model).whole["lm_head"] == "colwise_gather_output"
    neox, _ = build("gpt_neox")
    assert declared_plans(neox).whole["model.gpt_neox.layers.*.attention.query_key_value"] == "colwise"
    assert declared_plans(build("gpt2")[0]).whole == {}  # GPT-2 declares no plan


@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
def test_the_models_own_plan_compiles_to_megatrons_collectives_and_equals_one_device(name):
    model, inputs, program = compiled(name, "tp=2 tp_rules=model")
    (batch, seq), hidden, vocab = inputs[0].shape, 64, 256
    stream = batch * seq * hidden
    expected = (
        [("all_reduce", "forward", stream)] * (1 + 2 * LAYERS)  # embedding_rowwise, then g
        + [("all_gather", "forward", batch * seq * vocab)]  # lm_head: colwise_gather_output
        + [("all_reduce", "backward", stream)] * (1 + 2 * LAYERS)  # f of the head and layers
    )
    assert [(c.kind, c.phase, c.numel) for c in layer_collectives(program)] == expected
    assert_equals_one_device(program, model, inputs)  # the gathered logits: one device's loss


def test_gpt_neox_base_plan_as_is_compiles_to_megatrons_collectives_and_equals_one_device():
    model, inputs, graph = captured("gpt_neox")
    base_plan = model.model.config.base_model_tp_plan  # keys relative to model.model.gpt_neox
    program = fxpar.compile(graph, fxpar.Plan(tp=2, tp_rules=base_plan))
    stream = inputs[0].numel() * 64
    # its fused query_key_value is head-major, (B, T, heads, 3 * head_dim): a plain Shard(0)
    # gives each rank whole heads, and the view's -1 needs no rewrite
    qkv = "model.gpt_neox.layers.0.attention.query_key_value.weight"
    assert meta.placement(meta.parameter_nodes(program.graph_module.graph)[qkv], "tp") == Shard(0)
    expected = (
        [("all_reduce", "forward", stream)] * (1 + 2 * LAYERS)  # embedding_rowwise, then g
        + [("all_reduce", "backward", stream)] * 2 * LAYERS  # f; the head is replicated
    )
    assert [(c.kind, c.phase, c.numel) for c in layer_collectives(program)] == expected
    assert_equals_one_device(program, model, inputs)


def test_every_style_transformers_registers_has_a_meaning_or_a_plan_error():
    transformers_styles = pytest.importorskip("transformers.distributed.tensor_parallel")
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the EP styles)

    registered = set(transformers_styles.ALL_PARALLEL_STYLES.valid_keys())
    assert registered <= set(HF_STYLES) | set(UNSUPPORTED_HF_STYLES)


def test_unit_styles_split_whole_heads_exactly_and_refuse_to_copy_heads():
    """transformers' unit_colwise / unit_rowwise split attention by whole heads (MiniCPM5 declares
    them for k_proj and v_proj): with 2 key/value heads at tp=2 that is plain colwise/rowwise,
    exact. At tp=4 transformers would copy each key/value head onto two ranks; fxpar does not
    copy heads, and says so at compile with the fix, instead of splitting inside a head."""
    model, inputs, graph = captured("llama")
    unit = {"layers.*.self_attn.k_proj": "unit_colwise", "layers.*.self_attn.v_proj": "unit_colwise",
            "layers.*.self_attn.o_proj": "unit_rowwise"}
    rules = {**model.model.config.base_model_tp_plan, **unit}
    program = fxpar.compile(graph, fxpar.Plan(tp=2, tp_rules=rules))
    assert_equals_one_device(program, model, inputs)
    with pytest.raises(fxpar.PlanError, match=r"not divisible by tp=4 .*key/value heads"):
        fxpar.compile(graph, fxpar.Plan(tp=4, tp_rules=rules))


# -- 5. embedding arguments --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "mistral", "qwen2", "gpt_neox", "bert"])
def test_inferred_plan_equals_one_device(name):
    """Megatron's layout, inferred (auto for GPT-2 and BERT), Llama's is tested above."""
    model, inputs, program = compiled(name, "tp=2 tp_rules=infer")  # BERT's data: a pad token
    assert_equals_one_device(program, model, inputs)


def test_the_pad_row_of_a_vocabulary_parallel_embedding_gets_no_gradient():
    import transformers

    torch.manual_seed(0)
    pad = 200  # in rank 1's half of the vocabulary: it looks the row up by its local index
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, pad_token_id=pad,
    )
    model = LossOf(transformers.LlamaForCausalLM(config))  # untied: the head leaves row 200 be
    _, (ids, labels) = build("llama")
    ids[:, -4:] = pad
    program = fxpar.compile(model, "tp=2 tp_rules=infer", (ids, labels))  # vocabulary-parallel
    grads = assert_equals_one_device(program, model, (ids, labels))
    assert torch.equal(grads["model.model.embed_tokens.weight"][pad], torch.zeros(64))


def test_eager_attention_auto_plan_equals_one_device():
    model, inputs, program = compiled("gpt2", "tp=2", "eager")
    assert_equals_one_device(program, model, inputs)


def test_a_models_own_plan_skips_the_entries_its_configuration_lacks_with_one_warning():
    """Qwen3-MoE declares one plan for its family, naming the dense MLP some configurations put
    beside the experts (`layers.*.mlp.gate_proj`); an all-expert configuration has none.
    transformers skips such entries, and so does fxpar, naming them in one warning; the rest is
    the model's plan (attention split, experts replicated: the warning that tp splits 23% of
    the parameters comes too) and trains as one device. The same
    glob in a user's own mapping stays a PlanError: the user wrote it."""
    model, inputs, graph = captured("qwen3_moe")
    with pytest.warns(UserWarning, match=r"3 entries that match no module of this configuration") as record:
        program = fxpar.compile(graph, "tp=2")
    skipped = [str(w.message) for w in record if "match no module" in str(w.message)]
    assert len(skipped) == 1 and "'model.model.layers.*.mlp.gate_proj'" in skipped[0]
    assert_equals_one_device(program, model, inputs)
    with pytest.raises(fxpar.PlanError, match=r"tp_rules\['model.layers.\*.mlp.gate_proj'\] matches no module"):
        fxpar.compile(graph, fxpar.Plan(tp=2, tp_rules={"model.layers.*.mlp.gate_proj": "colwise"}))


def test_a_tp_plan_that_splits_little_of_the_model_says_so_in_one_warning():
    """Mamba's mixers match no projection rule, so tp=2 splits its embedding alone: a run that
    looks tensor-parallel and is not. One warning says what share is split; a transformer
    whose layers are split (Llama) gets none."""
    model, inputs = build("mamba", "eager")
    with pytest.warns(UserWarning, match=r"tp=2 splits only 22% of the parameters \(1 of 22 tensors: "
                                         r"'model\.backbone\.embeddings\.weight'\)") as record:
        fxpar.compile(model, "tp=2", example_inputs=inputs)
    assert sum("splits only" in str(w.message) for w in record) == 1
    _, _, graph = captured("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxpar.compile(graph, "tp=2")


@pytest.mark.parametrize("plan", ["tp=2", "tp=2 tp_rules=infer"])
def test_llama4_trains_under_its_own_plan_and_the_inferred_one(plan):
    """Llama 4 text: rotary positions as complex numbers (view_as_complex / view_as_real keep a
    head shard where it is) and the routed experts added in place into the shared expert's
    output while that still awaits its all-reduce (`x.add_(y)` placed as `x + y`: nothing else
    reads `x`). Its declared plan asks for `moe_tp_experts`, which fxpar does not do: those
    experts stay whole, said in a warning, and the rest of the plan holds."""
    model, inputs, graph = captured("llama4")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        program = fxpar.compile(graph, plan)
    said = " ".join(str(w.message) for w in record)
    assert ("'moe_tp_experts' (mixture-of-experts weights" in said) == (plan == "tp=2")
    assert_equals_one_device(program, model, inputs)


def test_an_in_place_write_into_a_split_value_with_another_reader_is_refused():
    """A view taken before the write aliases the value: on one device it sees the write, in the
    rewrite (the write lands in the all-reduce's result) it would not."""
    class WritesThroughAnAlias(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)  # h still partial

        def forward(self, x, y):
            h = self.down(self.up(x))
            alias = h.view(4, 2, 4)
            h.add_(x)
            return F.mse_loss(alias.flatten(1), y)

    x = torch.randn(4, 8)
    plan = fxpar.Plan(tp=2, tp_rules={"up": "colwise", "down": "rowwise"})
    with pytest.raises(fxpar.PlanError, match=r"cannot write in place into the split value linear_1 .*also reads "
                                              r"it.*Fix: keep module 'down' whole"):
        fxpar.compile(WritesThroughAnAlias(), plan, (x, x))


def test_deepseek_v3_latent_attention_trains_under_its_own_plan_and_the_inferred_one():
    """DeepSeek-V3 fills each key into an empty tensor slice by slice (its per-head part and
    the rotary part all heads share); capture writes that as the concatenation it is
    (`frontend.filled_buffers`), which tensor parallelism splits by heads like any other. Its
    declared plan asks for `mla_kv_a_proj`: that projection stays whole, said in a warning."""
    model, inputs, graph = captured("deepseek_v3")
    targets = {n.target for n in graph.graph_module.graph.nodes}
    assert torch.ops.aten.new_empty.default not in targets and torch.ops.aten.copy_.default not in targets
    torch.testing.assert_close(graph.graph_module(*inputs), model(*inputs), rtol=0, atol=0)
    with pytest.warns(UserWarning, match=r"'model.model.layers.\*.self_attn.kv_a_proj_with_mqa': 'mla_kv_a_proj'"):
        declared = fxpar.compile(graph, "tp=2")
    assert_equals_one_device(declared, model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the experts stay whole: tp splits a share of the rest
        inferred = fxpar.compile(graph, "tp=2 tp_rules=infer")
    assert_equals_one_device(inferred, model, inputs)
