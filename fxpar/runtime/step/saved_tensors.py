"""The saved-activation meter: bytes held for backward during a step, live and at their peak.

What `runner.memory_stats()["activations"]` reports and `program.estimate().memory
["activations"]` predicts (`cost.activations`). During a step the runner pushes
`torch.autograd.graph.saved_tensors_hooks` whose pack hook wraps every tensor autograd saves
in a `_Held` handle; the handle lives exactly as long as autograd keeps the saved value (it
is released when backward has used it, or with the graph), and counts its storage while it
lives. Storages are counted once however many saved tensors view them; the rank's
parameters and buffers (model state), the batch the step was given (its microbatches are
views of it) and the step's count of valid targets are left out. The peak is the largest
total held at any moment of the step.

Activation checkpointing hides a region's saved tensors from these hooks (torch's checkpoint
pushes its own, innermost), and keeps the region's *inputs* alive instead, in the closure
it recomputes from: `runtime.step.recompute` reports those to `hold_inputs`, held until backward
reaches the region (the first gradient of one of its outputs). Not counted: what a region's
recomputation allocates while its backward runs (one region's worth at a time), and the
inputs a zero-bubble schedule's W keeps in its store after B (`runtime.step.weight_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch


class SavedTensorMeter:
    """Counts distinct storages held for backward (module doc); one per runner."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # storage address -> live handles on it
        self._excluded: set[int] = set()
        self._active = False
        self.current = 0
        self.peak: int | None = None  # of the last step; None before the first

    @contextmanager
    def measuring(self, given: Iterable[torch.Tensor]) -> Iterator[None]:
        """Count what autograd saves inside the block, the storages of `given` (parameters,
        buffers, the step's batch) excepted; `peak` is then this block's."""
        self._excluded = {t.untyped_storage().data_ptr() for t in given}
        self.peak, self._active = self.current, True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._active = False

    def exclude(self, tensor: torch.Tensor) -> None:
        """Leave `tensor`'s storage out too: a step input made during the step, as the count
        of valid targets every microbatch's loss divides by (one tensor, however many hold it)."""
        self._excluded.add(tensor.untyped_storage().data_ptr())

    def composed(self, pack: Callable, unpack: Callable):
        """Hooks that run `pack` first and count what it leaves a tensor (ZeRO-3's gatherer
        packs a gathered weight as a recipe, model state either way): saved-tensor hooks do
        not nest, the innermost alone sees each save."""

        def both_pack(tensor: torch.Tensor) -> object:
            packed = pack(tensor)
            return self._pack(tensor) if packed is tensor and self._active else packed

        return torch.autograd.graph.saved_tensors_hooks(both_pack, lambda packed: unpack(_unpack(packed)))

    def hold_inputs(self, inputs: Iterable[object], outputs: Iterable[object]) -> None:
        """Count a checkpoint region's tensor `inputs` until backward reaches it: the first
        gradient computed for one of its `outputs` (nothing, where none needs a gradient)."""
        if not self._active:
            return
        needing = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not needing:
            return
        held = [self._pack(t) for t in inputs if isinstance(t, torch.Tensor)]

        def release(_gradients) -> None:
            held.clear()

        torch.autograd.graph.register_multi_grad_hook(needing, release, mode="any")

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self._excluded or storage.nbytes() == 0:
            return tensor
        return _Held(self, tensor, address, storage.nbytes())

    def count_in(self, address: int, nbytes: int) -> None:
        count = self._holders.get(address, 0)
        self._holders[address] = count + 1
        if count == 0:
            self.current += nbytes
            if self._active:
                self.peak = max(self.peak or 0, self.current)

    def count_out(self, address: int, nbytes: int) -> None:
        count = self._holders.pop(address) - 1
        if count:
            self._holders[address] = count
        else:
            self.current -= nbytes


class _Held:
    """One saved tensor, counted while autograd (or a checkpoint region) keeps it."""

    __slots__ = ("meter", "tensor", "address", "nbytes")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor, address: int, nbytes: int):
        self.meter, self.tensor, self.address, self.nbytes = meter, tensor, address, nbytes
        meter.count_in(address, nbytes)

    def __del__(self) -> None:
        self.meter.count_out(self.address, self.nbytes)


def _unpack(packed: object) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Held) else packed
