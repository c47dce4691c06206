"""Mesh axes by name: what a distributed op's `axis` argument means in this process.

A rank module names the mesh axis it communicates on (`torch.ops.fxpar.all_reduce(x, "tp")`)
and holds no group or communicator: the compiled program is data. `Program.bind()` connects
each axis name to this rank's process group on that axis, for the whole process, as
torch.distributed's own functional collectives resolve a group name through a process-wide
registry (`_c10d_functional.all_reduce(x, "sum", group_name)`): under torchrun one process is
one rank, so one binding per process is the model, not a shortcut. `Runner.close()` unbinds.

    bind_axes({"tp": runner_axis})        # Runner.create, after the process groups exist
    bound("tp").size, bound("tp").index   # inside an op's kernel
    unbind_axes()                          # Runner.close

What an op needs of an axis is `AxisBinding`; the runtime's is a process group plus the
communicator that counts and logs every call (`runtime.communicator.AxisOnGroup`), a test may
bind anything with these methods (tp ranks as threads of one process, for instance). A binding
that can also start a collective without waiting for it has `start_all_reduce`,
`start_all_gather`, `start_reduce_scatter` and `start_all_to_all` (the same arguments, returning what to `wait()`
on): a compiled graph then computes while the call is in flight (`ops.traced_collectives`); with
one that cannot, the call is waited for where it starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from fxpar.errors import BindError
from fxpar.ir.collectives import Phase


class AxisBinding(Protocol):
    """This rank's view of one mesh axis: its size, its index on it, and the collectives."""

    @property
    def size(self) -> int: ...

    @property
    def index(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, *, op: str, tag: str, phase: Phase) -> None:
        """Reduce `tensor` in place over the axis (op "sum" or "max") and wait."""

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: Phase) -> None:
        """Concatenate every rank's `tensor` along dim 0 into `output`, in axis order, and wait."""

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: Phase) -> None:
        """Sum `tensor` over the axis and keep this rank's dim-0 slice in `output`, and wait."""

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: Phase,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> None:
        """Send dim-0 block j of `tensor` to rank j and put rank j's block for this rank at
        block j of `output`, and wait; the blocks are equal unless split (rows per rank)."""


_bindings: dict[str, AxisBinding] = {}  # see the module doc for why this is process-wide


def bind_axes(bindings: Mapping[str, AxisBinding]) -> None:
    """Connect axis names to this process's bindings (replacing any earlier ones)."""
    _bindings.clear()
    _bindings.update(bindings)


def unbind_axes(bindings: Mapping[str, AxisBinding] | None = None) -> None:
    """Forget the bindings; given `bindings`, only while they are the ones bound (a runner
    closing must not unbind another's)."""
    if bindings is None or all(_bindings.get(axis) is b for axis, b in bindings.items()):
        _bindings.clear()


def bound(axis: str) -> AxisBinding:
    """The binding of `axis`; BindError when the program was not bound in this process."""
    try:
        return _bindings[axis]
    except KeyError:
        raise BindError(
            f"a rank module communicates on mesh axis {axis!r}, which is not bound in this "
            "process. Fix: run it through `program.bind()` inside torchrun (or bind the axes "
            "with fxpar.ir.axes.bind_axes for a test)"
        ) from None


@dataclass(frozen=True)
class PlannedAxis:
    """An axis as a rank will see it, for tracing its graph before any run: size and index
    only (an op's backward formula may read the index while AOTAutograd traces it, as the
    vocabulary-parallel embedding's does); moving data through it is an error."""

    size: int
    index: int

    def all_reduce(self, *tensors, tag: str, **options):
        raise RuntimeError(f"a planned axis moves no data ({tag}): the graph was run, not traced")

    all_gather = reduce_scatter = all_to_all = all_reduce


@contextmanager
def planned_axes(bindings: Mapping[str, PlannedAxis]) -> Iterator[None]:
    """`bindings` bound for the block, the process's own bindings (a live runner's) back after."""
    earlier = dict(_bindings)
    bind_axes(bindings)
    try:
        yield
    finally:
        bind_axes(earlier)
