"""An optimizer fxpar hands the user that steps another: ZeRO-1/2's `ShardedOptimizer` (over
this rank's flat shards) and bf16-mixed's `MixedPrecisionOptimizer` (over the fp32 masters).

Both keep the torch optimizer they step as `optimizer` and show its `param_groups`, `state`
and `defaults` as their own, and both are `torch.optim.Optimizer`s, so a training loop and a
learning-rate scheduler (which refuses anything else) treat them as the optimizer: a scheduler
setting a group's `lr` sets the inner optimizer's. `state_dict()` is the inner optimizer's,
this rank's own tensors' state, as a plain optimizer's is under tensor parallelism; the whole,
plan-independent state is `runner.full_optimizer_state_dict(optimizer)`. What reads the state
itself (checkpoints, the full state) asks `inner_optimizer`.
"""

from __future__ import annotations

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """The optimizer steps `self.optimizer`, whose groups and state it shows (module doc).

    `torch.optim.Optimizer.__init__` is not called: it would build groups and state of its own
    over the tensors given, where these must be the inner optimizer's very lists and dicts (a
    scheduler writes into the groups, the inner optimizer reads them)."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise TypeError(
            f"{type(self).__name__} steps tensors fxpar lays out (ZeRO's shards, bf16-mixed's fp32 "
            "masters), so it takes no parameter groups added later. Fix: train the parameters "
            "through the runner that made it, or build a torch optimizer of your own for others"
        )


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that holds `optimizer`'s state: the wrapped one, or itself."""
    return optimizer.optimizer if isinstance(optimizer, WrappedOptimizer) else optimizer
