"""Every collective fxpar issues goes through here: counted, logged and with clear failures.

`comm_stats()` answers "what did the steps since the last reset move?" with counts and payload
bytes per collective kind (all_reduce: its tensor; all_gather: its output; reduce_scatter and
all_to_all: its input; broadcast: its tensor), the quantities the cost model predicts. `log` keeps the current
step's calls as `Collective`s, the same record `Program.collectives(rank)` predicts, so tests
compare them call for call. Gathering the full state (`runtime.checkpoint.full_state`) happens outside any
step: its all-gathers count in the stats and stay out of the step's log.

During a step every call is first shown to the step's guard (`runtime.step.guard`), which
holds it to the rank's step program: a call the program does not list fails before it is made.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from fxpar.errors import CollectiveError, clipped
from fxpar.ir.collectives import Collective, CollectiveKind
from fxpar.runtime.collective_failures import describe_failure
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.step import numbers
from fxpar.runtime.step.guard import StepGuard

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11,
# the CUDA machine's, has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce(tensor: torch.Tensor, group: RankGroup, op: dist.ReduceOp) -> dist.Work:
    """Start an all-reduce on the group's ProcessGroup itself, as DDP's reducer does: a tensor
    parallel step makes dozens of calls, and `torch.distributed.all_reduce` re-validates the
    group, the tensor and the coalescing state in Python on each (about 10 us of CPU a call on
    gloo, measured); the communicator's callers pass a real, dense tensor of a group this rank
    belongs to, never inside a coalescing block."""
    if group.handle is None:  # a group of this rank alone has none: nothing may reduce on it
        raise CollectiveError(f"an all-reduce on the {clipped(group.name)}, which has no process group")
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return group.handle.allreduce([tensor], options)


def _reduce_scatter(
    output: torch.Tensor, tensor: torch.Tensor, group: RankGroup
) -> tuple[dist.Work, Callable[[], None] | None]:
    """Start summing `tensor` over `group` into this rank's dim-0 slice, `output`; return the
    work and what to run once it completed.

    On gloo with CPU tensors this is an all-to-all of the dim-0 blocks and a local sum of the
    blocks received, in rank order. Why not `reduce_scatter_tensor`: gloo has no reduce-scatter
    of its own, and torch's gloo backend makes one by cloning the whole input and all-reducing
    it, which moves twice the bytes a reduce-scatter needs; the all-to-all moves exactly what a
    ring reduce-scatter moves, (N-1)/N of the input, and measured 2-4x faster here (2 ranks,
    1-12 MiB: 4.9 ms against 1.8 at 4 MiB). NCCL's own reduce-scatter is used as it is."""
    if group.handle is None:
        raise CollectiveError(f"a reduce-scatter on the {clipped(group.name)}, which has no process group")
    if tensor.device.type != "cpu" or group.handle.name() != "gloo":
        return dist.reduce_scatter_tensor(output, tensor, group=group.handle, async_op=True), None
    received = torch.empty_like(tensor)
    work = group.handle.alltoall_base(received, tensor, [], [], dist.AllToAllOptions())
    blocks, mine = received.view(group.size, -1), output.view(-1)
    return work, functools.partial(torch.sum, blocks, 0, out=mine)


class PendingCollective:
    """An asynchronous collective; `wait()` raises CollectiveError naming the group, the time
    really waited since the call was issued, and the cause (`runtime.collective_failures`)."""

    def __init__(self, work: dist.Work | None, call: Collective, group: RankGroup, timeout: timedelta,
                 then: Callable[[], None] | None = None):
        """`then`: run once the call completed (a riding step agreement's check, the local sum
        that ends a reduce-scatter on gloo)."""
        self._work, self._call, self._group, self._timeout = work, call, group, timeout
        self._then = then
        self._issued = time.perf_counter()

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait(self._timeout)
        except Exception as error:
            call, group = self._call, self._group
            cause = describe_failure(error, ranks=group.ranks, rank=group.rank,
                                     waited=time.perf_counter() - self._issued, timeout=self._timeout)
            raise CollectiveError(
                f"{call.kind} of {call.tag} ({call.payload_bytes:,} bytes) on the "
                f"{clipped(group.name)} {cause}"
            ) from error
        finally:
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


@dataclass(frozen=True)
class Transfer:
    """Point-to-point: `tensors` to send to, or buffers to receive from, global rank `peer`."""

    kind: Literal["send", "recv"]
    tensors: list[torch.Tensor]
    peer: int
    tag: str  # what the tensors are, for logs and errors: "stage 1 activations"
    phase: str  # "forward" or "backward"
    key: int  # unique per stage, microbatch and direction within a step: the wire tags


@dataclass(frozen=True)
class AxisOnGroup:
    """A mesh axis bound to this rank's process group on it (`fxpar.ir.axes.AxisBinding`): what a
    rank module's `torch.ops.fxpar` ops resolve their axis name to, through the communicator."""

    group: RankGroup
    communicator: Communicator

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def index(self) -> int:
        return self.group.index

    def all_reduce(self, tensor: torch.Tensor, *, op: str, tag: str, phase: str) -> None:
        self.start_all_reduce(tensor, op=op, tag=tag, phase=phase).wait()

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: str) -> None:
        self.start_all_gather(output, tensor, tag=tag, phase=phase).wait()

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: str) -> None:
        self.start_reduce_scatter(output, tensor, tag=tag, phase=phase).wait()

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: str,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> None:
        self.start_all_to_all(output, tensor, tag=tag, phase=phase, output_splits=output_splits,
                              input_splits=input_splits).wait()

    def start_all_reduce(self, tensor: torch.Tensor, *, op: str, tag: str, phase: str) -> PendingCollective:
        return self.communicator.all_reduce_started(tensor, self.group, tag=tag, op=op, phase=phase)

    def start_all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: str,
                         output_splits: list[int] | None = None,
                         input_splits: list[int] | None = None) -> PendingCollective:
        return self.communicator.all_to_all(output, tensor, self.group, tag=tag, phase=phase,
                                            output_splits=output_splits, input_splits=input_splits)

    def start_all_gather(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str, phase: str) -> PendingCollective:
        return self.communicator.all_gather(output, tensor, self.group, tag=tag, phase=phase)

    def start_reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, *, tag: str,
                             phase: str) -> PendingCollective:
        return self.communicator.reduce_scatter(output, tensor, self.group, tag=tag, phase=phase)


class Communicator:
    def __init__(self, timeout: timedelta):
        self.timeout = timeout
        self.log: list[Collective] = []  # the calls of the current step (or since reset)
        self._stats: dict[str, dict[str, int]] = {}
        self._guard: StepGuard | None = None  # during a step: holds each call to the program
        self._agreements: list[Callable[[], object]] = []  # step agreements in flight, to settle
        self._step = 0  # the running step's number (`start_step`)

    def all_reduce(self, tensor: torch.Tensor, group: RankGroup, *, tag: str, phase: str = "backward",
                   agreement: bool = False) -> PendingCollective:
        """Start a sum all-reduce of `tensor` in place over `group`; an `agreement` (a step
        agreement's, `runtime.step.agreement`) leaves the agreements in flight unsettled.

        Where the step program says this call carries the step agreement (a gradient bucket,
        `lowering.ride_agreements`), `tensor`'s last elements are the room its caller left for
        the slots: they get this rank's step number here, and `wait()` checks the sums before
        the caller reads anything (`runtime.step.numbers`)."""
        slots = self._guard.agreement_slots(group.ranks) if self._guard is not None else 0
        then = None
        if slots:
            riding = tensor.view(-1)[-slots:]
            riding.copy_(numbers.slots(group, self._step, dtype=tensor.dtype, device=tensor.device))
            then = functools.partial(numbers.check, group, self._step, riding)
        call = self._record("all_reduce", tensor, group, tag, phase=phase, agreement=agreement, slots=slots)
        work = _all_reduce(tensor, group, dist.ReduceOp.SUM)
        return PendingCollective(work, call, group, self.timeout, then)

    def reduce_scatter(
        self, output: torch.Tensor, tensor: torch.Tensor, group: RankGroup, *, tag: str, phase: str = "backward"
    ) -> PendingCollective:
        """Start summing `tensor` over `group` into this rank's dim-0 slice, `output` (which
        may be that slice of `tensor` itself: the reduction is then in place)."""
        call = self._record("reduce_scatter", tensor, group, tag, phase=phase)
        work, then = _reduce_scatter(output, tensor, group)
        return PendingCollective(work, call, group, self.timeout, then)

    def all_gather(
        self, output: torch.Tensor, tensor: torch.Tensor, group: RankGroup, *, tag: str, phase: str,
        log: bool = True,
    ) -> PendingCollective:
        """Start concatenating every rank's `tensor` along dim 0 into `output` (`tensor` may be
        this rank's slice of it); `log=False` outside a step."""
        call = self._record("all_gather", output, group, tag, op="none", phase=phase, log=log)
        work = _all_gather_single(output, tensor, group=group.handle, async_op=True)
        return PendingCollective(work, call, group, self.timeout)

    def all_to_all(
        self, output: torch.Tensor, tensor: torch.Tensor, group: RankGroup, *, tag: str, phase: str,
        output_splits: list[int] | None = None, input_splits: list[int] | None = None,
    ) -> PendingCollective:
        """Start sending dim-0 block j of `tensor` to the group's rank j, receiving rank j's
        block for this rank into block j of `output`: equal blocks, or rows per rank as split
        (token dispatch, `ops.token_dispatch`). Its payload is what this rank sends, `tensor`."""
        call = self._record("all_to_all", tensor, group, tag, op="none", phase=phase)
        work = dist.all_to_all_single(output, tensor, output_splits, input_splits, group=group.handle, async_op=True)
        return PendingCollective(work, call, group, self.timeout)

    def all_reduce_started(
        self, tensor: torch.Tensor, group: RankGroup, *, tag: str, op: str = "sum", phase: str, log: bool = True
    ) -> PendingCollective:
        """Start all-reducing `tensor` in place (sum or max); `log=False` outside a step. Where
        the step program says this call carries the step agreement (`lowering.ride_agreements`),
        the ranks' step numbers ride at its end, and the wait checks them before `tensor` gets
        the sum (`runtime.step.numbers`)."""
        slots = self._guard.agreement_slots(group.ranks) if self._guard is not None else 0
        then, payload = None, tensor
        if slots:
            step = self._step
            payload = torch.cat((tensor.reshape(-1),
                                 numbers.slots(group, step, dtype=tensor.dtype, device=tensor.device)))

            def then() -> None:
                numbers.check(group, step, payload[-slots:])
                tensor.copy_(payload[:-slots].view_as(tensor))
        call = self._record("all_reduce", payload, group, tag, op=op, phase=phase, slots=slots, log=log)
        work = _all_reduce(payload, group, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return PendingCollective(work, call, group, self.timeout, then)

    def all_reduce_now(
        self, tensor: torch.Tensor, group: RankGroup, *, tag: str, op: str = "sum", phase: str, log: bool = True
    ) -> None:
        """`all_reduce_started`, waited for."""
        self.all_reduce_started(tensor, group, tag=tag, op=op, phase=phase, log=log).wait()

    def all_gather_now(
        self, output: torch.Tensor, tensor: torch.Tensor, group: RankGroup, *, tag: str, phase: str,
        log: bool = True,
    ) -> None:
        """`all_gather`, waited for."""
        self.all_gather(output, tensor, group, tag=tag, phase=phase, log=log).wait()

    def reduce_scatter_now(
        self, output: torch.Tensor, tensor: torch.Tensor, group: RankGroup, *, tag: str, phase: str
    ) -> None:
        """`reduce_scatter`, waited for."""
        self.reduce_scatter(output, tensor, group, tag=tag, phase=phase).wait()

    def exchange(self, rank: int, transfers: list[Transfer]) -> list[list[PendingCollective]]:
        """Start every transfer as one `torch.distributed.batch_isend_irecv` batch; one list of
        pending operations per transfer, to wait for before reusing (send) or reading (recv).

        One batch is one NCCL group, whose sends and receives progress together: the pipeline
        executor puts an action's sends in the batch with the receives it posts next, as
        Megatron-LM's `send_forward_recv_backward` and torch's 1F1B do, so two ranks never
        wait for each other on a pair's in-order stream. Each tensor has its own tag
        (`key` x 16 + its index), by which gloo matches messages.
        """
        operations, pending = [], []
        for transfer in transfers:
            pair = RankGroup(axis=None, ranks=tuple(sorted((rank, transfer.peer))), handle=None, rank=rank)
            op = dist.isend if transfer.kind == "send" else dist.irecv
            calls = []
            for i, tensor in enumerate(transfer.tensors):
                calls.append(self._record(transfer.kind, tensor, pair, transfer.tag, op="none", phase=transfer.phase))
                operations.append(dist.P2POp(op, tensor, transfer.peer, tag=transfer.key * 16 + i))
            pending.append((calls, pair))
        works = iter(dist.batch_isend_irecv(operations) if operations else ())
        return [[PendingCollective(next(works), call, pair, self.timeout) for call in calls]
                for calls, pair in pending]

    def all_gather_pieces(self, tensor: torch.Tensor, group: RankGroup, *, tag: str) -> list[torch.Tensor]:
        """Every rank's `tensor` (one shape on all ranks), in group order, and wait. Outside a
        step: counted in `stats()` (as an all_gather of its output), not in the step's `log`."""
        pieces = [torch.empty_like(tensor) for _ in range(group.size)]
        call = self._record("all_gather", tensor, group, tag, op="none", phase="step", log=False,
                            numel=tensor.numel() * group.size)
        work = dist.all_gather(pieces, tensor.contiguous(), group=group.handle, async_op=True)
        PendingCollective(work, call, group, self.timeout).wait()
        return pieces

    def broadcast(
        self, tensor: torch.Tensor, group: RankGroup, *, tag: str, source: int = 0, log: bool = True
    ) -> None:
        """Broadcast `tensor` in place from the group's rank at index `source`, and wait for
        it; `log=False` outside a step (counted in `stats()`, not in the step's `log`)."""
        call = self._record("broadcast", tensor, group, tag, op="none", phase="step", log=log)
        work = dist.broadcast(tensor, src=group.ranks[source], group=group.handle, async_op=True)
        PendingCollective(work, call, group, self.timeout).wait()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per collective kind: how many calls and how many payload bytes since the last reset."""
        return {kind: dict(entry) for kind, entry in self._stats.items()}

    def reset(self) -> None:
        """Zero the counters and forget the log."""
        self._stats.clear()
        self.log.clear()

    def start_step(self, guard: StepGuard | None = None, step: int = 0) -> None:
        """Start one step's log (a long run does not grow it without bound); with a `guard`
        (already started at the step's sizes), hold every call to the step program; `step`:
        the rank's step number, for an agreement riding in a call (`runtime.step.numbers`)."""
        self.log.clear()
        self._guard, self._step = guard, step

    def settle_before_data(self, settle: Callable[[], object]) -> None:
        """Run `settle` (it waits for a step agreement in flight and raises StepMismatchError
        unless the group's members are on one step) before the next call that is not itself an
        agreement, or at the end of the step: the agreement overlaps the step's first compute,
        and still no collective moves the step's data before the ranks agree."""
        self._agreements.append(settle)

    def settle_agreements(self) -> None:
        """Settle the step agreements in flight, in the order they were started."""
        while self._agreements:
            self._agreements.pop(0)()

    def end_step(self, *, check: bool = True) -> None:
        """The step is over: its agreements are settled and its guard checks that no listed
        call was left out (`check=False` for a step that failed: its error says what went
        wrong, and an agreement still in flight is left to complete on its own)."""
        guard, self._guard = self._guard, None
        if not check:
            self._agreements.clear()
            return
        self.settle_agreements()
        if guard is not None:
            guard.finish()

    @contextlib.contextmanager
    def held_to(self, guard: StepGuard):
        """Hold the calls made inside the block to `guard` (started), outside a step: the log
        stays the last step's."""
        self._guard = guard
        try:
            yield
            guard.finish()
        finally:
            self._guard = None

    def _record(
        self,
        kind: CollectiveKind,
        tensor: torch.Tensor,
        group: RankGroup,
        tag: str,
        op: str = "sum",
        phase: str = "backward",
        log: bool = True,
        agreement: bool = False,
        slots: int = 0,
        numel: int | None = None,
    ) -> Collective:
        """Admit a call of `tensor` (`numel`: its payload's elements where that is not the
        tensor's own count): settle the step agreements in flight unless the call is one
        (`agreement`), hold it to the guard (which raises if the program does not list it, and
        hands back the listed call), then log it (`log`: a step's call) and count it. `slots`:
        step-number slots riding at the end of `tensor`."""
        if self._agreements and not agreement:
            self.settle_agreements()
        numel = tensor.numel() if numel is None else numel
        if self._guard is not None:
            call = self._guard.admit(kind, group.ranks, numel, tensor.dtype, op, tag, channel=group.channel)
        else:
            call = Collective(kind=kind, group=group.ranks, numel=numel, dtype=tensor.dtype, op=op,
                              tag=tag, phase=phase, agreement=slots, channel=group.channel)
        if log:
            self.log.append(call)
        return self._count(call)

    def _count(self, call: Collective) -> Collective:
        entry = self._stats.setdefault(call.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += call.payload_bytes
        return call
