"""ZeRO-3 at run time: each layer gathered once per use, prefetched, and re-gathered for backward.

The ZeRO-3 pass (`passes.zero3`) writes the ops; this is their eager form for one bound rank
module, as `ops.distributed.lower_for_eager` is for the other ops. At bind the gatherer points
every `gather_parameters` and `regather_parameters` node of the module at its own methods:

    forward   gather_parameters of layer k: wait for layer k's all-gather (issue it now if it
              is not in flight), then issue the next `prefetch` layers' (in forward order)
    backward  regather_parameters of layer k (the first of layer k's backward): the same, in
              backward order, into what the forward's saved tensors are re-made from
              gather_parameters of layer k: issue one reduce-scatter of the layer's
              gradients, and drop the layer's re-gathered values. Reducing once per step
              (`fxpar.plan.zero_reduction`), the step's earlier backwards only add the layer's
              whole gradients into one buffer, and its last reduce-scatters their sum
    after a backward   `land()`: wait for the reduce-scatters still in flight and hand each
              piece its summed gradient (into `.grad`, or added to it)

The reduce-scatter is not waited for where it is issued: the backward of the layers below runs
while it is on the wire, as FSDP2's reduce-scatter stream does. At most one stays in flight
(issuing a layer's lands the layer's before it), so only one layer's whole gradients outlive
their layer's backward, and the executors `land()` the last after each backward, before anything
reads a gradient (the tied and tensor-parallel sums, the optimizer). The pieces' gradients are
therefore set by the gatherer, not by autograd (the gather's backward returns none for them):
the same values, summed in the same order, with `.grad` a view of the reduce-scatter's output
as autograd left it.

Which calls go out when is what `lowering.prefetched` wrote into the step program, so the
step guard admits them.

With `reshard_after_forward`, forward runs inside `saving()`: a saved-tensor hook
(`torch.autograd.graph.saved_tensors_hooks`) packs a tensor that lies in the memory of a layer
gathered again for backward (all but the root's) as (layer, output, geometry) instead of the
tensor, so nothing keeps the layer's whole weights alive after its forward; unpacking in
backward re-makes the view on the layer's re-gathered values, which are bit-identical (the
same pieces, gathered the same way). The root's layer is not gathered again (`passes.zero3`):
what autograd saves of it (the head's weight) is kept as it is, until the head's backward.
A checkpoint region (`runtime.step.recompute`, activation checkpointing) would keep its inputs,
the layer's whole weights among them, until backward: it takes those as the same recipes
(`region_input`), and its recomputation reads them off the backward's re-gather
(`region_value`). No collective is issued that the step program does not list: the region
ends before the layer's `regather_parameters` (ZeRO-3's ops are in no region), whose backward
is the re-gather the recomputation reads.

Under bf16-mixed with `reduce_dtype=fp32` the pieces are fp32 and each gather node names bf16
(`passes.zero3`): the copy-in casts them, and the reduce-scatter sums the gradients in the
pieces' fp32.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar.ops.parameter_gathers import OP, REGATHER, laid_out, laid_out_gradients, whole_values
from fxpar.runtime.communicator import Communicator, PendingCollective
from fxpar.runtime.process_groups import RankGroup

GATHER_TARGET = torch.ops.fxpar.gather_parameters.default
REGATHER_TARGET = torch.ops.fxpar.regather_parameters.default


@dataclass
class _Layer:
    shards: list[torch.Tensor]  # this rank's pieces, the module's parameters
    dtype: torch.dtype | None = None  # what the gather moves, when not the pieces' (bf16-mixed)
    pending: PendingCollective | None = None
    flat: torch.Tensor | None = None  # the gathered flat buffer in flight or done
    outputs: list[torch.Tensor] | None = None  # the re-gathered values (backward)
    # Reducing once per step: the whole gradients of the step's backwards so far, and how many.
    accumulated: torch.Tensor | None = None
    backwards: int = 0


class ParameterGatherer:
    """The ZeRO-3 ops of one rank module, run eagerly (module doc)."""

    def __init__(self, module: fx.GraphModule, group: RankGroup, communicator: Communicator, *,
                 prefetch: int, reshard_after_forward: bool, per_microbatch: bool = True):
        self.group, self.communicator, self.depth = group, communicator, prefetch
        self.per_microbatch = per_microbatch  # else the gradients are reduced once per step
        self.microbatches = 1  # of the step running (`start_step`)
        gathers = [n for n in module.graph.nodes if n.target is GATHER_TARGET]
        regathers = [n for n in module.graph.nodes if n.target is REGATHER_TARGET]
        index = {tuple(n.args[0]): k for k, n in enumerate(gathers)}
        # The layers gathered again for backward (every one but the root's: `passes.zero3`);
        # the others' whole values are saved for backward as they are.
        self.regathered = {index[tuple(n.args[1])] for n in regathers}
        self.reshard = reshard_after_forward and bool(self.regathered)
        self.layers = [_Layer([_parameter(module, s) for s in n.args[0]], n.kwargs.get("dtype")) for n in gathers]
        self.forward_order = list(range(len(gathers)))
        self.backward_order = [index[tuple(n.args[1])] for n in reversed(regathers)]
        # storage pointer -> the gathered value living there (while it lives)
        self._by_storage: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._reducing: list[_Reducing] = []  # the layers' reduce-scatters in flight, oldest first
        for k, node in enumerate(gathers):
            node.target = self._gather_function(k)
        for node in regathers:
            node.target = self._regather_function(index[tuple(node.args[1])])
        module.recompile()

    def start_step(self, microbatches: int) -> None:
        """Expect a step of `microbatches` backwards: reducing once per step, each layer's
        reduce-scatter goes out in the last of them (`fxpar.plan.zero_reduction`)."""
        self.microbatches = microbatches
        self._reducing.clear()  # what a failed step left in flight
        for layer in self.layers:
            layer.accumulated, layer.backwards = None, 0

    # -- the calls --------------------------------------------------------------------------

    def _issue(self, k: int, *, tag: str, phase: str) -> None:
        layer = self.layers[k]
        if layer.pending is None and layer.flat is None:
            flat = laid_out(layer.shards, layer.dtype)
            layer.flat = flat.new_empty(self.group.size * flat.numel())
            layer.pending = self.communicator.all_gather(layer.flat, flat, self.group, tag=tag, phase=phase)

    def _take(self, k: int, order: list[int], *, tag: str, phase: str) -> list[torch.Tensor]:
        """Layer k's whole values: its gather waited for, the next `depth` in `order` issued."""
        self._issue(k, tag=tag, phase=phase)
        layer = self.layers[k]
        layer.pending.wait()
        position = order.index(k)
        for later in order[position + 1 : position + 1 + self.depth]:
            self._issue(later, tag=tag, phase=phase)
        flat, layer.flat, layer.pending = layer.flat, None, None
        return whole_values(flat, [s.numel() for s in layer.shards], self.group.size)

    def _gather_function(self, k: int):
        gatherer = self

        class Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, axis, size, *shards):
                outputs = gatherer._take(k, gatherer.forward_order, tag=OP.tag(axis, "forward"), phase="forward")
                if k in gatherer.regathered:
                    for j, out in enumerate(outputs):
                        gatherer._remember(out, k, j)
                ctx.widths, ctx.shapes, ctx.axis, ctx.size = [s.numel() for s in shards], [s.shape for s in shards], axis, size
                ctx.dtype = shards[0].dtype
                return tuple(outputs)

            @staticmethod
            def backward(ctx, *grads):
                layer = gatherer.layers[k]
                layer.outputs = None  # the layer's backward is over
                like = next(g for g in grads if g is not None)
                # summed in the pieces' dtype (fp32 pieces under bf16-mixed: reduce_dtype=fp32)
                stacked = laid_out_gradients(list(grads), ctx.widths, like, ctx.size, ctx.dtype, into=layer.accumulated)
                layer.backwards += 1
                if not gatherer.per_microbatch and layer.backwards < gatherer.microbatches:
                    layer.accumulated = stacked  # reduced with the step's last backward
                    return None, None, *(None for _ in ctx.widths)
                layer.accumulated, layer.backwards = None, 0
                gatherer._reduce(k, stacked, ctx.widths, tag=OP.tag(ctx.axis, "backward"))
                return None, None, *(None for _ in ctx.widths)

        def gather_parameters(shards, axis, size, dtype=None):
            return list(Gather.apply(axis, size, *shards))

        return gather_parameters

    def _reduce(self, k: int, stacked: torch.Tensor, widths: list[int], *, tag: str) -> None:
        """Issue layer k's reduce-scatter of its whole gradients `stacked`, landing the one in
        flight before it (module doc)."""
        pieces = stacked.new_empty(stacked.shape[1])
        pending = self.communicator.reduce_scatter(pieces, stacked.reshape(-1), self.group, tag=tag)
        self._reducing.append(_Reducing(pending, stacked, pieces.split(widths), self.layers[k].shards))
        while len(self._reducing) > 1:
            self._reducing.pop(0).land()

    def land(self) -> None:
        """Wait for the reduce-scatters in flight and give the pieces their gradients: call
        after each backward, before a gradient is read."""
        while self._reducing:
            self._reducing.pop(0).land()

    def _regather_function(self, k: int):
        gatherer = self

        class Regather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                gatherer._regathered(k)
                return grad

        def regather_parameters(x, shards, axis, size, dtype=None):
            return Regather.apply(x)

        return regather_parameters

    def _regathered(self, k: int) -> list[torch.Tensor]:
        layer = self.layers[k]
        if layer.outputs is None:
            layer.outputs = self._take(k, self.backward_order, tag=REGATHER.tag("dp", "backward"), phase="backward")
        return layer.outputs

    # -- saved tensors ------------------------------------------------------------------------

    def saving(self):
        """The context forward runs in: gathered values saved for backward as recipes."""
        if not self.reshard:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def hooks(self):
        """`saving`'s (pack, unpack) hooks, or None where nothing is packed as a recipe: for
        a caller that composes them with its own (`runtime.step.saved_tensors`)."""
        return (self._pack, self._unpack) if self.reshard else None

    def _remember(self, out: torch.Tensor, k: int, j: int) -> None:
        out.fxpar_gathered = (k, j)  # which layer's output it is, for `_pack`
        self._by_storage[out.untyped_storage().data_ptr()] = out

    def _pack(self, tensor: torch.Tensor):
        pointer = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else None
        out = self._by_storage.get(pointer)
        if out is None or out.untyped_storage().data_ptr() != pointer:
            return tensor
        k, j = out.fxpar_gathered
        return _Recipe(k, j, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def _unpack(self, packed):
        if not isinstance(packed, _Recipe):
            return packed
        whole = self._regathered(packed.layer)[packed.output]
        return whole.as_strided(packed.shape, packed.stride, packed.offset)

    # -- checkpoint regions (`runtime.step.recompute`) -------------------------------------------

    def region_input(self, value):
        """What a checkpoint region takes in place of `value`, one of its inputs: a value lying
        in a gathered layer's memory as its recipe, holding the value itself only weakly (the
        checkpoint keeps its inputs until backward, and these are the layer's whole weights);
        anything else itself. Only with `reshard_after_forward` (else the weights stay
        gathered anyway)."""
        if not self.reshard or not isinstance(value, torch.Tensor):
            return value
        recipe = self._pack(value)
        if recipe is value:
            return value
        return _RegionInput(recipe, weakref.ref(value), value.requires_grad)

    def region_value(self, taken):
        """`region_input`'s value back: in forward the value itself (still alive: the module
        is reading it), in the region's recomputation the same view of the layer's re-gathered
        values (bit-identical), a leaf that requires grad as the value did, so the recomputed
        ops save what they saved in forward."""
        if not isinstance(taken, _RegionInput):
            return taken
        value = taken.value()
        if value is not None:
            return value
        return self._unpack(taken.recipe).detach().requires_grad_(taken.requires_grad)


@dataclass(frozen=True)
class _Reducing:
    """A layer's gradients on the wire: its reduce-scatter, and where the sums go."""

    pending: PendingCollective
    stacked: torch.Tensor  # the whole gradients sent, alive until the call completes
    sums: tuple[torch.Tensor, ...]  # this rank's piece of each summed gradient, flat
    shards: list[torch.nn.Parameter]  # the pieces they are the gradients of

    def land(self) -> None:
        self.pending.wait()
        for shard, summed in zip(self.shards, self.sums):
            if shard.grad is None:
                shard.grad = summed.view(shard.shape)
            else:  # a later microbatch's, reduced on its own: autograd's accumulation
                shard.grad.add_(summed.view(shard.shape))


@dataclass(frozen=True)
class _RegionInput:
    """A checkpoint region's input that lies in a gathered layer's memory (`region_input`)."""

    recipe: _Recipe
    value: weakref.ref
    requires_grad: bool


@dataclass(frozen=True)
class _Recipe:
    """A saved tensor that lies in a gathered layer's memory, as what re-makes it."""

    layer: int
    output: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _parameter(module: fx.GraphModule, node: fx.Node) -> torch.nn.Parameter:
    return module.get_parameter(node.target)
