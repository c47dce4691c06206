"""What a placement rule decides, and what it may ask: the vocabulary of `propagation`.

A rule (`passes.tensor_parallel.propagation.RULES`, `passes.tensor_parallel.view_rules`) sees a node and a `Context`
and returns a `Decision`; the tensor-parallel pass carries it out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from fxpar.ir.placement import Partial, Placement, R, Replicate, Shard


class Rewrite(enum.Enum):
    """What `passes.tensor_parallel.rewrite` changes in the op itself for local shards."""

    LOCAL_SIZES = "a view's size constants"
    LOCAL_SPLIT = "a fused projection's split sizes"
    LOCAL_SLICE = "a slice taking one block of a fused projection"
    BIAS_AFTER_REDUCTION = "a row-parallel bias, added after the sum"
    VOCAB_PARALLEL_EMBEDDING = "a lookup in a vocabulary shard"
    VOCAB_PARALLEL_CROSS_ENTROPY = "cross entropy over vocabulary-sharded logits"


@dataclass
class Decision:
    output: Placement | list[Placement]
    inputs: dict[fx.Node, Placement] = field(default_factory=dict)
    rewrite: Rewrite | None = None
    # Where the output goes right where it is produced, for every use (None: it stays `output`).
    settle_to: Placement | None = None


class Context:
    """What rules may ask: placements so far, global shapes, the degree, sequence parallelism."""

    def __init__(self, placements: dict[fx.Node, Placement], tp: int, sequence_parallel: bool, seq):
        self.placements, self.tp, self.sequence_parallel, self.seq = placements, tp, sequence_parallel, seq

    def placement(self, node: fx.Node) -> Placement:
        return self.placements.get(node, R)

    def has_seq_dim(self, node: fx.Node) -> bool:
        shape = shape_of(node)
        return len(shape) >= 3 and shape[1] in self.seq

    def sequence_shard(self, node: fx.Node, inputs: dict[fx.Node, Placement]) -> fx.Node | None:
        """Under sequence parallelism, the one replicated stream input a norm or dropout should
        take on sequence shards (Korthikanti et al. 2022, Sec. 4.2.2), if there is one."""
        if not self.sequence_parallel or any(not isinstance(p, Replicate) for p in inputs.values()):
            return None
        streams = [n for n in inputs if self.has_seq_dim(n)]
        return streams[0] if len(streams) == 1 and self.has_seq_dim(node) else None

    def partial_target(self, node: fx.Node) -> Placement:
        """Where a partial sum goes before non-linear math: whole, or sequence-sharded under SP."""
        if self.sequence_parallel and self.has_seq_dim(node):
            return Shard(1)
        return R


def is_tensor(node: object) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def shape_of(node: fx.Node) -> tuple:
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d) for d in node.meta["val"].shape)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if is_tensor(n)]


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _resolve_partials(node, ctx, inputs) -> dict:
    return {n: (ctx.partial_target(n) if isinstance(p, Partial) else p) for n, p in inputs.items()}
