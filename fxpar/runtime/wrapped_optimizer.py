"""An optimizer fxpar hands the user that steps another: ZeRO-1/2's `ShardedOptimizer` (over
this rank's flat shards) and bf16-mixed's `MixedPrecisionOptimizer` (over the fp32 masters).

Both keep the torch optimizer they step as `optimizer` and show its `param_groups` and `state`
as their own, so a training loop (and a learning-rate scheduler) treats them as the optimizer;
what reads the state itself (checkpoints, the full optimizer state) asks `inner_optimizer`.
"""

from __future__ import annotations

import torch


class WrappedOptimizer:
    """The optimizer steps `self.optimizer`, whose groups and state it shows (module doc)."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that holds `optimizer`'s state: the wrapped one, or itself."""
    return optimizer.optimizer if isinstance(optimizer, WrappedOptimizer) else optimizer
