"""How a step's pieces' losses combine into the one-device loss (`passes.loss_normalisation`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

COUNT_INPUT = "valid_targets"  # the graph input a loss summed over valid targets is divided by


@dataclass(frozen=True)
class LossReduction:
    """How a step's pieces combine into the one-device loss (see module doc).

    `sums`: each piece returns its sum divided by the global count of valid targets, which
    `count_module(*piece_inputs)` counts per piece; pieces' losses and gradients are summed.
    Otherwise each piece returns its own mean, and pieces are averaged.
    """

    sums: bool
    count_module: fx.GraphModule | None = None
    count_dtype: torch.dtype = torch.float32  # of `valid_targets`: the loss's own dtype
    reason: str = ""  # why not `sums`, for the warning
    # The loss adds to the cross entropy a term of the batch's statistics (a router's
    # load-balancing loss or z-loss: products of means over the tokens), the graph node
    # `STATISTICS` marks; `passes.batch_statistics` makes them the global batch's.
    statistics: bool = False


STATISTICS = "fxpar.loss_statistics"  # node meta: the term of batch statistics the loss adds
