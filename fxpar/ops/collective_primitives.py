"""The six primitives a distributed op's forward or backward is made of, run on one rank.

    identity        a copy (a custom op may not return an alias of its input)
    slice           this rank's piece of `dim`, a copy
    all_reduce      the sum (or max) over the axis
    all_gather      every rank's piece, concatenated along `dim` in axis order
    reduce_scatter  the sum over the axis, this rank's piece of `dim`
    all_to_all      piece j of `dim` sent to rank j; piece j of the result is rank j's piece
                    for this rank (its own transpose: the backward is the same call)

`run` does one and returns its result. The four that communicate are two halves: `launch`
starts the collective on the axis's binding and hands back the buffer it fills, `landed`
turns that buffer into the result once the call completed. Run op by op the halves follow each
other. In a compiled graph they are two ops apart (`started`): `fxpar::collective_start`
registers the call's completion with torch's functional collectives, and
`torch.ops._c10d_functional.wait_tensor` waits for it, so Inductor sees the call as the
issue-and-wait pair its own collectives are, and a schedule can compute between the two
(`runtime.collective_schedule`). The binding still issues the call, so the step guard and
`comm_stats()` see it as they see every other.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_work

from fxpar.errors import BindError
from fxpar.ir.axes import bound
from fxpar.ir.collectives import Phase

Primitive = Literal["identity", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "slice"]
COMMUNICATING = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class _Done:
    """A call that completed when it was started (a binding that cannot start without waiting)."""

    def wait(self) -> None:
        pass


def _binding(axis: str, size: int, primitive: Primitive):
    """The axis's binding, which must have the size the op was compiled for (an all-reduce's
    result does not depend on it, and its ops do not carry it)."""
    binding = bound(axis)
    if primitive != "all_reduce" and binding.size != size:
        raise BindError(f"an op was compiled for {size} ranks on axis {axis!r}, bound to {binding.size}")
    return binding


def _start(binding, kind: str, *tensors: torch.Tensor, **options):
    """Start `kind` on `binding` and return what to wait on; a binding without `start_<kind>`
    (`fxpar.ir.axes`) runs the call to completion here."""
    start = getattr(binding, f"start_{kind}", None)
    if start is None:
        getattr(binding, kind)(*tensors, **options)
        return _Done()
    return start(*tensors, **options)


def launch(primitive: Primitive, x: torch.Tensor, axis: str, size: int, dim: int, reduce: str, tag: str,
           phase: Phase, in_place: bool = False, own_input: bool = False):
    """Start the collective `primitive` on this rank's `x`: (the buffer it fills, what to wait
    on). `in_place`: an all-reduce may overwrite `x` (contiguous) rather than a copy.
    `own_input`: the call reads a copy of `x` of its own, never `x`'s memory (see
    `_collective_start`).

    The collectives move rank blocks along dim 0, so each rank's block is laid out as a leading
    dimension of `size`: one copy per call, of the gathered result (`landed`) or of the
    scattered input (moving `dim` to the front and back copied both the input and the result)."""
    binding = _binding(axis, size, primitive)
    if primitive == "all_reduce":
        out = x if in_place else x.clone(memory_format=torch.contiguous_format)
        return out, _start(binding, "all_reduce", out, op=reduce, tag=tag, phase=phase)
    owned = (lambda t: t.clone() if t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else t
             ) if own_input else (lambda t: t)
    if primitive == "all_gather":
        stacked = x.new_empty((size, *x.shape))
        return stacked, _start(binding, "all_gather", stacked.flatten(0, 1), owned(x.contiguous()), tag=tag,
                               phase=phase)
    stacked = owned(x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous())
    if primitive == "all_to_all":
        out = torch.empty_like(stacked)
        return out, _start(binding, "all_to_all", out.flatten(0, 1), stacked.flatten(0, 1), tag=tag, phase=phase)
    out = x.new_empty(stacked.shape[1:])
    return out, _start(binding, "reduce_scatter", out, stacked.flatten(0, 1), tag=tag, phase=phase)


def landed(primitive: Primitive, buffer: torch.Tensor, dim: int) -> torch.Tensor:
    """A launched call's result from its completed buffer: an all-gather's or all-to-all's
    rank blocks moved into `dim`; the other two leave the buffer as it is."""
    if primitive in ("all_gather", "all_to_all"):
        return buffer.movedim(0, dim).flatten(dim, dim + 1).contiguous()
    return buffer


def run(primitive: Primitive, x: torch.Tensor, axis: str, size: int, dim: int, reduce: str, tag: str,
        phase: Phase, in_place: bool = False) -> torch.Tensor:
    """One primitive on this rank's `x`, waited for."""
    if primitive == "identity":
        return x.clone()
    if primitive == "slice":
        index = _binding(axis, size, primitive).index
        return x.chunk(size, dim=dim)[index].clone(memory_format=torch.contiguous_format)
    buffer, pending = launch(primitive, x, axis, size, dim, reduce, tag, phase, in_place)
    pending.wait()
    return landed(primitive, buffer, dim)


def fake(primitive: Primitive, x: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """The result's shape as an empty tensor (fake kernels)."""
    shape = list(x.shape)
    if primitive == "all_gather":
        shape[dim] = shape[dim] * size
    elif primitive in ("slice", "reduce_scatter"):
        shape[dim] = shape[dim] // size
    return x.new_empty(shape)


# -- the two halves as graph ops -----------------------------------------------------------------


_RECOMPUTABLE = "|"  # between a call's forward tag and the tag it has when recomputed in backward


def recomputable(forward_tag: str, backward_tag: str) -> str:
    """The tag of a call a compiled backward may run again as a recomputation (`_collective_start`)."""
    return f"{forward_tag}{_RECOMPUTABLE}{backward_tag}"


def forward_tag(tag: str) -> str:
    """A start's tag as its forward call has it."""
    return tag.split(_RECOMPUTABLE)[0]


class _InFlight(dist.Work):
    """A started call as torch's functional collectives track one: `wait_tensor` on its buffer
    calls `wait`, which is the binding's own (the communicator's errors and timeout, and what
    runs after the call: a gloo reduce-scatter's local sum, a riding step agreement's check)."""

    def __init__(self, pending):
        super().__init__()
        self.pending = pending

    def wait(self, timeout=None) -> bool:
        self.pending.wait()
        return True


@torch.library.custom_op(
    "fxpar::collective_start", mutates_args=(),
    schema="(Tensor x, str axis, int size, int dim, str primitive, str reduce, str tag, str phase) -> Tensor",
)
def _collective_start(x, axis, size, dim, primitive, reduce, tag, phase):
    """`launch` as an op: the buffer the call fills, registered so that
    `_c10d_functional.wait_tensor(buffer)` waits for it. A `tag` of two, "forward|backward",
    names a call that a compiled backward may run again as a recomputation (ZeRO-3's gather,
    `ops.recomputed_gathers`): the second, with phase backward, when autograd's engine runs it."""
    if _RECOMPUTABLE in tag:
        forward_tag, backward_tag = tag.split(_RECOMPUTABLE)
        recomputed = torch._C._current_graph_task_id() != -1
        tag, phase = (backward_tag, "backward") if recomputed else (forward_tag, phase)
    # The call reads its input after this op returns, until `wait_tensor`; Inductor, seeing a
    # functional op, may give the input's memory to another kernel meanwhile (a compiled
    # `dp=4 ep=2` step's expert-group reduce-scatter read rows a later kernel had overwritten:
    # wrong gradients). So the call reads a copy of its own.
    buffer, pending = launch(primitive, x, axis, size, dim, reduce, tag, phase, own_input=True)
    _register_work(buffer, _InFlight(pending))
    return buffer


@_collective_start.register_fake
def _(x, axis, size, dim, primitive, reduce, tag, phase):
    if primitive == "all_gather":
        return x.new_empty((size, *x.shape))
    if primitive == "all_to_all":  # the rank blocks stacked in front, as `launch` lays them out
        return x.new_empty(x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).shape)
    return fake(primitive, x, size, dim)


def started(primitive: Primitive, x: torch.Tensor, axis: str, size: int, dim: int, tag: str,
            phase: Phase, reduce: str = "sum") -> torch.Tensor:
    """A communicating primitive as three steps a traced graph keeps apart: start, wait, land."""
    buffer = torch.ops.fxpar.collective_start(x, axis, size, dim, primitive, reduce, tag, phase)
    return landed(primitive, torch.ops._c10d_functional.wait_tensor(buffer), dim)
