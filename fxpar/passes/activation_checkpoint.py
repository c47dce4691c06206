"""Activation checkpointing: mark the nodes a rank recomputes in backward instead of saving.

`checkpoint=full` recomputes every transformer block, `checkpoint=selective` only attention's
core (Korthikanti et al. 2022, Sec. 5); `fxpar.ir.recompute_regions` holds the rule and what
selective means for `scaled_dot_product_attention`. This pass writes each recomputed node's
region into `fxpar.recompute`; the graph's computation is unchanged, so every later reader
(lowering's step program, the cost model's per-rank shares, the pictures) still sees every
op where it was. The runtime turns each run of marked nodes into one
`torch.utils.checkpoint.checkpoint(use_reentrant=False)` call (`runtime.step.recompute`), and the
cost model prices the marks (`cost.activations`: the bytes kept; `cost.layout`: the
recomputed FLOPs).

    before: %linear_3 = linear(%view_3, %h_0_attn_o_weight, ...)       meta: {}
    after:  %linear_3 = linear(%view_3, %h_0_attn_o_weight, ...)       meta: {fxpar.recompute: "h.0"}

It runs last on every graph a rank executes (the whole graph, or each pipeline stage), so the
nodes earlier passes inserted are marked too, and it needs the model's block lists from the
whole captured graph (a stage holds only some blocks): `pass_list` finds them and refuses a
model without any (`blocks`).

Why marks and not recomputation written into the graph: fxpar's backward is eager autograd
over each rank's GraphModule, and torch's non-reentrant checkpoint already recomputes a
region in backward, restores the RNG state so dropout draws the same mask (its default,
`preserve_rng_state=True`), and composes with custom autograd functions (the zero-bubble
deferred linear, which records its weight gradient from the recomputed input). A
hand-written recomputation would duplicate all three.

Contract.
Requires: `fxpar.module_path` on the model's nodes (trace.capture).
Ensures: exactly the nodes `recompute_regions.region_labels(graph, mode, blocks)` returns
carry `fxpar.recompute`, with that label; no distributed op whose forward is a collective
of the step program is marked, but context parallelism's key and value gathers under
`regather` (checked); nothing else in the graph changes.
"""

from __future__ import annotations

import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.recompute_regions import communicates_in_forward, regathered, region_labels
from fxpar.passes.contracts import broken, ensures


def no_collective_recomputed(gm: fx.GraphModule) -> None:
    """Ensures: no distributed op whose forward communicates carries a recompute mark, but
    context parallelism's key and value gathers (`recompute_regions.regathered`)."""
    for node in gm.graph.nodes:
        if meta.recompute_region(node) is not None and communicates_in_forward(node) and not regathered(node):
            raise broken("a collective is never recomputed", node)


@ensures(no_collective_recomputed)
def mark_recomputation(gm: fx.GraphModule, *, mode: str, blocks: tuple[str, ...], regather: bool = False) -> fx.GraphModule:
    """Mark `gm`'s recomputed nodes in place (contract in the module doc); returns it.
    `regather`: context parallelism's gathers of keys and values are recomputed too."""
    labels = region_labels(gm.graph, mode, blocks, regather=regather)
    for node in gm.graph.nodes:
        node.meta.pop(meta.RECOMPUTE, None)
        if node in labels:
            node.meta[meta.RECOMPUTE] = labels[node]
    return gm
