"""fp32 master weights of bf16 working parameters (`precision=bf16-mixed`).

The graph computes in bf16 (`passes.mixed_precision`): a parameter whose node carries
`fxpar.master_dtype` is stored in bf16, its working copy. Its fp32 values, what training
really updates, live here, as in DeepSpeed and the ZeRO paper's accounting (2 bytes of
weights, 2 of gradients, 12 of Adam state: master, m, v):

    bind             every replica identical (fp32), then each such parameter's fp32 tensor
                     becomes its master and the parameter a bf16 copy (`keep`);
    ZeRO-1/2         only this rank's shard of each flat bucket keeps a master (`shard`):
                     4P/N bytes, the shard the sharded optimizer steps;
    ZeRO-3           with reduce_dtype=bf16 each bf16 piece has its fp32 master here; with
                     fp32 the pieces are fp32 and are their own masters (`passes.zero3`):
                     nothing here, the optimizer steps them with their fp32 gradients;
    optimizer step   master.grad = the (reduced) gradient in fp32, the inner optimizer steps
                     the masters, and each working copy is the master rounded to bf16
                     (ZeRO: the shard, then gathered in bf16 by `ShardedOptimizer`).

The masters count under `optimizer` in `runner.memory_stats()`, as the estimate counts them
(`cost.memory`), and `runner.full_state_dict()` returns them, not the rounded working copies.
Why not torch.amp: autocast casts each weight at every use (a 2-byte copy per use that
backward keeps) and keeps the fp32 parameter beside it; storing the weight in bf16 is what
gives 2P + 2P + 12P, and the graph says so where the ops are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fxpar.ir import meta
from fxpar.runtime.state.wrapped_optimizer import WrappedOptimizer

if TYPE_CHECKING:
    from fxpar.runtime.state.gradient_buckets import GradientBuckets


class MasterWeights:
    """The fp32 masters of a rank's bf16 working parameters (module doc)."""

    def __init__(self, per_parameter: dict[int, tuple[torch.nn.Parameter, torch.Tensor]]):
        self._per_parameter = per_parameter  # id(working) -> (working, master)
        self._working = set(per_parameter)  # ids of every working copy, sharded masters or not
        self._shards: dict[tuple[int, int], torch.Tensor] = {}  # (module, bucket) -> master shard

    @classmethod
    def keep(cls, modules) -> MasterWeights:
        """Make each parameter the graph computes in another dtype than it holds a working copy
        in that dtype, keeping its current tensor as the master (call once replicas agree)."""
        per_parameter = {}
        with torch.no_grad():
            for module in modules:
                for name, node in meta.parameter_nodes(module.graph).items():
                    parameter = module.get_parameter(name)
                    working = node.meta["val"].dtype
                    if meta.master_dtype(node) is None or id(parameter) in per_parameter or parameter.dtype == working:
                        continue
                    master = parameter.data
                    parameter.data = master.to(working)
                    per_parameter[id(parameter)] = (parameter, master)
        return cls(per_parameter)

    def __bool__(self) -> bool:
        return bool(self._per_parameter or self._shards)

    @property
    def dtype(self) -> torch.dtype | None:
        """The masters' dtype (what full-state gathers move), None without masters."""
        for tensor in self.tensors():
            return tensor.dtype
        return None

    def is_working(self, parameter: torch.Tensor) -> bool:
        """Whether `parameter` is a working copy (its master whole here, or sharded)."""
        return id(parameter) in self._working

    def master_of(self, parameter: torch.Tensor) -> torch.Tensor | None:
        pair = self._per_parameter.get(id(parameter))
        return None if pair is None else pair[1]

    def shard(self, buckets: list[GradientBuckets]) -> None:
        """ZeRO-1/2: keep masters only for this rank's shard of each flat bucket of each module
        (`Bucket.shard`, laid out as `sharded_optimizer.flatten_parameters`); the whole
        per-parameter masters of bucketed parameters are let go."""
        for module, module_buckets in enumerate(buckets):
            group = module_buckets.group
            for index, state in enumerate(module_buckets.states):
                masters = [self.master_of(p) for p in state.parameters]
                if any(m is None for m in masters):
                    continue
                flat = torch.zeros(state.size, dtype=masters[0].dtype, device=state.device)
                offset = 0
                for master in masters:
                    flat[offset : offset + master.numel()].copy_(master.reshape(-1))
                    offset += master.numel()
                self._shards[(module, index)] = flat[state.bucket.shard(group.size, group.index)].clone()
                for p in state.parameters:
                    self._per_parameter.pop(id(p), None)

    def shard_of(self, module: int, bucket: int) -> torch.Tensor | None:
        return self._shards.get((module, bucket))

    def tensors(self) -> list[torch.Tensor]:
        return [m for _, m in self._per_parameter.values()] + list(self._shards.values())

    def full_precision(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict's tensors with each working parameter as its master (under ZeRO, where
        this rank holds a shard of the master, its working copy in the master's dtype)."""
        dtype = self.dtype
        result = {}
        for key, tensor in tensors.items():
            master = self.master_of(tensor)
            if master is None and id(tensor) in self._working:
                master = tensor.detach().to(dtype)
            result[key] = tensor if master is None else master
        return result


class MixedPrecisionOptimizer(WrappedOptimizer):
    """`optimizer_class` over the fp32 masters of the parameters of `param_groups` (torch.optim's
    groups; one device's fp32 optimizer step, on the masters), writing the rounded result into
    the bf16 working copies. A parameter without a master steps itself. Use it as the
    optimizer: `step`, `zero_grad`; `optimizer` is the inner one."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], options: dict[str, Any], *,
                 param_groups: list[dict[str, Any]], masters: MasterWeights):
        self._pairs = [(p, m if (m := masters.master_of(p)) is not None else p)
                       for group in param_groups for p in group["params"]]
        stepped = dict(self._pairs)  # a working parameter -> what is stepped for it
        self.optimizer = optimizer_class(
            [{**group, "params": [stepped[p] for p in group["params"]]} for group in param_groups], **options)

    def master_of(self, parameter: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer steps for `parameter` (its master, or itself)."""
        return next(m for p, m in self._pairs if p is parameter)

    def step(self, closure: Callable | None = None):
        for working, master in self._pairs:
            if master is not working:
                master.grad = None if working.grad is None else working.grad.to(master.dtype)
        loss = self.optimizer.step(closure)
        with torch.no_grad():
            for working, master in self._pairs:
                if master is not working:
                    working.copy_(master)
                    master.grad = None  # a transient fp32 copy of the gradient
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for working, _ in self._pairs:
            if set_to_none:
                working.grad = None
            elif working.grad is not None:
                working.grad.zero_()
