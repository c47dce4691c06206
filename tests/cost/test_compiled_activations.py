"""ZeRO-3 under `compile=inductor`: the compiled form of a rank module (`ops.recomputed_gathers`)
and what its estimate keeps for backward (`cost.compiled_activations`).

The launch in tests/runtime/test_compiled_equivalence.py holds the measured activations to
the estimate and the collectives to the step program; here, in one process, the form itself
and the bytes that re-gathering by recomputation saves: with `reshard_after_forward` the
compiled forward keeps none of the re-gathered layers' whole weights for backward, so its
activations are smaller than without by at least those layers' weight matrices (what every
linear's backward reads) and at most their whole parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fxpar
from fxpar.ir import meta
from fxpar.ops.recomputed_gathers import GATHER, REGATHER, regathered_by_recomputation

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _program(plan: str):
    model = GPT(CONFIG)
    tokens = torch.randint(0, 64, (4, 16))
    return model, fxpar.compile(model, plan, (tokens, tokens.clone()))


def test_the_compiled_form_recomputes_every_regathered_layer_and_keeps_the_roots():
    _, program = _program("dp=2 zero=3 compile=inductor")
    module = program.rank_module(0)
    compiled = regathered_by_recomputation(module)
    assert not any(n.target is REGATHER for n in compiled.graph.nodes)
    gathers = [n for n in compiled.graph.nodes if n.target is GATHER]
    assert len(gathers) == 1 + CONFIG.n_layer  # the root's unit, then one per block
    root, *blocks = gathers
    assert meta.recompute_region(root) is None  # kept for backward, as in eager mode
    labels = [meta.recompute_region(g) for g in blocks]
    assert None not in labels and len(set(labels)) == len(blocks)
    for gather, label in zip(blocks, labels):
        cuts = [n for n in compiled.graph.nodes if meta.recompute_region(n) == label]
        whole = [n for n in cuts if n.target is torch.ops.aten.view.default]
        assert len(whole) == len(gather.args[0])  # every parameter's whole value is recomputed
    assert dict(compiled.named_parameters()).keys() == dict(module.named_parameters()).keys()
    assert all(a is b for a, b in zip(compiled.parameters(), module.parameters()))
    # The rank module itself, which lowering and the pictures read, keeps its regathers.
    assert sum(n.target is REGATHER for n in module.graph.nodes) == CONFIG.n_layer


def test_a_module_without_regathers_is_its_own_compiled_form():
    _, program = _program("dp=2 zero=3 reshard_after_forward=false compile=inductor")
    module = program.rank_module(0)
    assert regathered_by_recomputation(module) is module


def test_resharding_compiled_layers_keeps_none_of_their_weights_for_backward():
    model, resharded = _program("dp=2 zero=3 compile=inductor")
    _, kept = _program("dp=2 zero=3 reshard_after_forward=false compile=inductor")
    saved = kept.estimate().memory["activations"] - resharded.estimate().memory["activations"]
    layers = [p for name, p in model.named_parameters() if name.startswith("h.")]
    matrices = sum(p.numel() * p.element_size() for p in layers if p.dim() == 2)
    whole = sum(p.numel() * p.element_size() for p in layers)
    assert matrices <= saved <= whole, (matrices, saved, whole)
