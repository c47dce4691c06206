"""Gradient buckets: the parameters whose gradients one collective reduces together.

`passes.data_parallel` makes them (in the order backward produces gradients) and records them
on the graph (`meta.graph_buckets`); lowering issues one all-reduce or reduce-scatter per
bucket, and the runtime (`runtime.state.gradient_buckets`) fills and launches them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxpar.ir.placement import flat_piece


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are all-reduced together, in gradient-ready order."""

    index: int
    parameters: tuple[str, ...]  # canonical parameter names
    numel: int
    dtype: torch.dtype  # of its parameters and their gradients (bf16 under bf16-mixed)
    held: bool = False  # reduced only after a step-end sum of its gradient (ZeRO; see below)
    # The dtype its gradients are summed over dp in, when not `dtype`: the plan's
    # `reduce_dtype` under bf16-mixed (FSDP2's MixedPrecisionPolicy.reduce_dtype).
    reduce_dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def reduced_dtype(self) -> torch.dtype:
        """What its gradients are reduced in, and what ZeRO's reduced shard of them holds."""
        return self.reduce_dtype or self.dtype

    def padded(self, ranks: int) -> int:
        """Its elements rounded up to a multiple of `ranks`: a flat buffer that splits into
        `ranks` equal shards, as a reduce-scatter needs (ZeRO): each a FlatShard piece."""
        return flat_piece(self.numel, ranks) * ranks

    def shard(self, ranks: int, index: int) -> slice:
        """Which elements of the padded flat buffer the rank at `index` of `ranks` owns."""
        size = flat_piece(self.numel, ranks)
        return slice(index * size, (index + 1) * size)
