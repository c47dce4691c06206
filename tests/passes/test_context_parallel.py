"""Context parallelism's rewrite, read off the compiled graph, and the input it refuses.

The rank module of `cp=2` reads the whole inputs, takes its slice of the token ids where the
embedding reads them, sizes its views for the slice, and gathers keys and values over cp for
attention; each refusal names what was wrong (the field, the node and its module path) and a
fix, at compile time, before any rank runs. (That training equals one device:
tests/runtime/test_context_parallel_equivalence.py.)
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import P, R, Shard

sys.path.insert(0, str(Path(__file__).parents[1]))
from small_gpt import small_capture  # noqa: E402


def calls(module, name: str) -> list:
    return [n for n in module.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_rank_module_slices_the_inputs_and_gathers_keys_and_values():
    program = fxpar.compile(small_capture(), "cp=2")
    module = program.rank_module(1)
    (ids,) = [n for n in calls(module, "split_to_shard") if n.args[0].name == "idx"]
    assert ids.args[1:] == ("cp", 2, 1)  # the token ids' dim 1, where the embedding reads them
    gathers = calls(module, "gather_to_region")
    assert len(gathers) == 4 and {g.args[1:] for g in gathers} == {("cp", 2, 2)}  # k and v of 2 layers
    for attention in calls(module, "scaled_dot_product_attention"):
        assert attention.args[1] in gathers and attention.args[2] in gathers
        assert attention.args[3] is not None and not attention.kwargs.get("is_causal")  # the causal rows
    graph = program.graph_module.graph
    placed = {n.name: meta.placement(n, "cp") for n in graph.nodes if "val" in n.meta and n.op != "output"}
    assert placed["linear"] == Shard(1) and placed["idx"] == R and placed["cross_entropy_loss"] == P
    assert set(meta.partial_gradient_parameters(graph, "cp")) == set(program.captured.parameters)


def test_views_are_sized_for_the_ranks_slice():
    module = fxpar.compile(small_capture(), "cp=2").rank_module(0)
    (view,) = [n for n in module.graph.nodes if n.name == "view"]  # q.view(B, T, nh, hs)
    seq = view.args[1][1]
    assert seq.target.__name__ == "floordiv" and seq.args[1] == 2


def test_step_collectives_are_the_gathers_and_the_sums_over_cp():
    program = fxpar.compile(small_capture(), "cp=2")
    tags = [c.tag for c in program.collectives(0)]
    assert tags.count("cp gather_to_region") == 4 and tags.count("cp gather_to_region (backward)") == 4
    assert "cp partial parameter gradients" in tags and "cp loss" in tags


def test_a_sequence_not_divisible_by_cp_is_refused():
    model, inputs = small_gpt_model(seq=15)
    with pytest.raises(PlanError, match=r"cp=2 shards the sequence over cp=2 ranks, and the example's "
                       r"sequence length 15 is not divisible by 2. Fix: use sequences of 14 or 16") as caught:
        fxpar.compile(model, "cp=2", inputs)
    assert caught.value.field == "cp"


def test_sequence_parallelism_inside_cp_is_refused():
    with pytest.raises(PlanError, match=r"plan cp=2 with sp=true: both split the sequence.*Fix: sp=false") as caught:
        fxpar.Plan.parse("cp=2 tp=2 sp=true")
    assert caught.value.field == "sequence_parallel"


class Pooled(nn.Module):
    """A classifier over the mean of its tokens: a read across the whole sequence."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 8), nn.Linear(8, 4)

    def forward(self, ids, label):
        return F.cross_entropy(self.head(self.embed(ids).mean(1)), label)


class ScoresByHand(nn.Module):
    """Attention written out as matmuls, as Hugging Face's eager attention is."""

    def __init__(self):
        super().__init__()
        self.embed, self.qk, self.head = nn.Embedding(32, 8), nn.Linear(8, 16), nn.Linear(8, 32)

    def forward(self, ids, targets):
        x = self.embed(ids)
        q, k = self.qk(x).chunk(2, -1)
        x = torch.softmax(q @ k.transpose(1, 2), -1) @ x
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_a_read_across_the_sequence_is_refused_naming_the_node_and_module():
    ids = torch.randint(0, 32, (4, 8))
    with pytest.raises(PlanError, match=r"mean.* reads across the sequence dim.* Fix: .*cp=1") as caught:
        fxpar.compile(Pooled(), "cp=2", (ids, torch.randint(0, 4, (4,))))
    assert caught.value.field == "cp"
    with pytest.raises(PlanError, match=r"matmul.* multiplies two activations.*scaled_dot_product_attention"):
        fxpar.compile(ScoresByHand(), "cp=2", (ids, ids))


def test_attention_dropout_is_refused():
    model, inputs = small_gpt_model(seq=16, dropout=0.1)
    with pytest.raises(PlanError, match=r"cp=2: this model draws random numbers \(dropout\).*Fix: set the model's "
                       r"dropout probabilities to 0"):
        fxpar.compile(model, "cp=2", inputs)


def small_gpt_model(*, seq: int, dropout: float = 0.0):
    """examples/gpt.py at one layer, its dropout modules at `dropout`."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    from gpt import factory

    model, inputs = factory(n_layer=1, n_head=2, n_embd=16, vocab_size=32, seq=seq, batch=4)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = dropout
    return model, inputs


def test_with_attention_recomputed_each_cp_rank_keeps_a_cp_th_of_the_activations():
    """Attention keeps the keys and values it gathered; recomputing its core gathers them again
    in backward instead (`recompute_regions.regathered`), and then a rank's saved activations
    are 1/cp of one device's. (The equivalence tests hold the rank's measured bytes equal to
    the estimate's, and its collectives, the regathers among them, equal to the prediction.)"""
    from hf_models import builder

    model, inputs = builder("llama")("sdpa")
    captured = fxpar.capture(model, inputs)
    saved = {plan: fxpar.compile(captured, plan).estimate("h100").memory["activations"]
             for plan in ("checkpoint=selective", "cp=2 checkpoint=selective", "dp=1", "cp=2")}
    assert saved["cp=2 checkpoint=selective"] / saved["checkpoint=selective"] == pytest.approx(0.5, rel=0.05)
    assert saved["cp=2"] / saved["dp=1"] > 0.52  # the whole sequence's keys and values, kept
    program = fxpar.compile(captured, "cp=2 checkpoint=selective")
    backward = [c.tag for c in program.collectives(0) if c.phase != "step"][1 + 4:]  # after the forward's
    assert backward[:4] == ["cp gather_to_region", "cp gather_to_region", "cp gather_to_region (backward)",
                            "cp gather_to_region (backward)"]  # the last layer: gathered again, then reduced


def test_a_model_that_fixes_the_sequence_length_inside_is_refused():
    """Mamba's scan loops over the positions in Python: the capture fixes the length of its
    token ids (labels keep theirs), so no activation is split. Without the refusal each rank
    computed the whole sequence's loss and cp summed it twice (found by tests/hf_survey.py)."""
    from hf_models import builder

    model, inputs = builder("mamba")("eager")
    with pytest.raises(PlanError, match=r"the loss is not computed from activations split along the sequence.*"
                       r"fixed it in input_ids \(s\d+, 16\).*Fix: cp=1") as caught:
        fxpar.compile(model, "cp=2", inputs)
    assert caught.value.field == "cp"


def test_a_pipeline_cuts_between_blocks_when_one_tensor_is_both_the_ids_and_the_labels():
    """One tensor given as the token ids and the labels is one input: a slice of it shared by
    the embedding and the loss lived across every block, and no cut between blocks was clean
    ("3 clean cut points, too few for 8 stages"). Each reader takes its own slice."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=32, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (8, 16), device="meta")
    program = fxpar.compile(model, "cp=2 tp=2 pp=8 mb=8", (tokens, tokens), check=False)
    assert len(program.stages) == 8
    slices = [n for n in program.graph_module.graph.nodes if "split_to_shard" in str(n.target)]
    assert len({n.args[0] for n in slices if n.args[0].op == "placeholder"}) == 1 < len(slices)


def test_the_cost_model_charges_a_cp_rank_its_slice_of_the_work():
    """Each op cp splits is 1/cp of the op's work on a rank (`cost.layout`): the matmuls and
    attention of cp=2 are half of one device's, exactly (the whole values cp computes on every
    rank, positions and masks, are no matmuls)."""
    from fxpar.cost.layout import shares

    one, halves = (shares(fxpar.compile(small_capture(), plan))[0] for plan in ("dp=1", "cp=2"))
    assert halves.matmul_flops == one.matmul_flops / 2
    assert halves.attention_flops == one.attention_flops / 2
