"""Expert routing under expert parallelism: which gathered tokens this rank's experts take.

Rank i of an expert group of size n holds experts [i E/n, (i+1) E/n) of a layer's E. After
the group's tokens are gathered (`passes.expert_parallel`), every rank sees every token's
expert; one op in the `fxpar` namespace, which does not communicate, turns each expert id
into a key for this rank:

    local_experts(expert_ids, axis, experts) -> keys
        the id as one of this rank's experts (0 .. E/n - 1), or E/n for an expert held
        elsewhere; int64, no gradient.
    group_rows(rows, axis, tokens) -> rows + index x tokens
        indices into this rank's `tokens` tokens as indices into the group's tokens gathered
        in axis order (this rank's start at its index x tokens); no gradient.

The all-to-all dispatcher (`ops.token_dispatch`) needs one more, which does not read the rank:

    expert_order(received, experts, rows) -> order
        the rows received from each rank in turn, each block sorted by expert
        (`received[j x experts + e]` rows of this rank's expert e from rank j), put in order
        by expert, stably: rank 0's rows of expert 0 first, as one device's stable sort
        groups them. `rows` is their number (the fake kernel's size; module doc of
        `ops.token_dispatch`); no gradient.

Sorted (stably), the keys put this rank's tokens first, grouped by its experts in the order
one device groups them, and everyone else's last, where the grouped matmul does not reach.
The rank's index is read when the op runs (`fxpar.ir.axes.bound`), as the vocabulary-parallel
ops read theirs, so one program serves every rank.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.ir.axes import bound


def is_grouped_mm(node: fx.Node) -> bool:
    """A grouped matmul over 3D expert weights, `(rows, k) x (experts, k, n) -> (rows, n)`
    with each expert's rows given by offsets: transformers' `grouped_mm_fallback` or torch's
    `_grouped_mm`."""
    target = node.target if node.op == "call_function" else None
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return (target.namespace, target.overloadpacket.__name__) in {
        ("transformers", "grouped_mm_fallback"), ("aten", "_grouped_mm")}


@torch.library.custom_op("fxpar::local_experts", mutates_args=(),
                         schema="(Tensor expert_ids, str axis, int experts) -> Tensor")
def local_experts(expert_ids: torch.Tensor, axis: str, experts: int) -> torch.Tensor:
    group = bound(axis)
    mine = experts // group.size
    keys = expert_ids.long() - group.index * mine
    return keys.masked_fill((keys < 0) | (keys >= mine), mine)


@local_experts.register_fake
def _(expert_ids, axis, experts):
    return torch.empty_like(expert_ids, dtype=torch.int64)


@torch.library.custom_op("fxpar::group_rows", mutates_args=(),
                         schema="(Tensor rows, str axis, SymInt tokens) -> Tensor")
def group_rows(rows: torch.Tensor, axis: str, tokens: int) -> torch.Tensor:
    return rows + bound(axis).index * tokens


@group_rows.register_fake
def _(rows, axis, tokens):
    return torch.empty_like(rows)


@torch.library.custom_op("fxpar::expert_order", mutates_args=(),
                         schema="(Tensor received, int experts, SymInt rows) -> Tensor")
def expert_order(received: torch.Tensor, experts: int, rows: int) -> torch.Tensor:
    blocks = received.numel() // experts
    keys = torch.arange(experts, device=received.device).repeat(blocks).repeat_interleave(received, output_size=rows)
    return torch.sort(keys, stable=True).indices


@expert_order.register_fake
def _(received, experts, rows):
    return received.new_empty((rows,), dtype=torch.int64)
