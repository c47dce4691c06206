"""The step's count of valid targets arrives while the forward runs.

A mean cross entropy is compiled into sum / global count of valid targets
(`passes.loss_normalisation`). Where the count cannot ride in the first gradient bucket
(`lowering.ride_agreements`: ZeRO, a pipeline's last stage), it is summed over dp by the step
program's first action, VALID_TARGETS, whose all-reduce also carries every member's step
number (`runtime.step.agreement`). The graph reads the count once, in its last op (the division),
so waiting for that all-reduce before the forward would add a synchronisation point to every
step: each rank stalls until the slowest has finished its optimizer step, then again at the
gradient buckets. DDP has one such point a step, at the buckets; under load the second costs
more than the tiny all-reduce itself.

So the all-reduce starts at the top of the step, and the rank's graph waits for it where it
reads the count: at bind, the runtime puts a call to the step's `CountArrival` between the
graph's `valid_targets` input and its first user (`await_count`), as it points the
distributed ops at their eager forms (`ops.distributed.lower_for_eager`); the compiled program
is unchanged, and the same call runs in the same position of the step program:

    valid_targets_arrived = fxpar_runtime_valid_targets_arrive(valid_targets)  # waits, checks steps
    div = torch.ops.aten.div.Tensor(sum_1, valid_targets_arrived)

When it arrives, the ranks' step numbers are checked (StepMismatchError as before); nothing of
the step has been reduced over dp by then: the gradient buckets start in backward, and the
executors settle the count before the first backward in any case. (ZeRO-3's forward gathers
parameters on dp before it: parameters, not the step's data.) The values are the blocking
path's to the bit: the same sum, converted to the count's dtype once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from fxpar.ir.loss_reduction import COUNT_INPUT

ARRIVED = "valid_targets_arrived"


class CountArrival:
    """This rank's count for the running step: `expect` it (the all-reduce in flight and the
    tensor the graph is given), then `arrive(tensor)` (the graph does) or `settle()` (the
    executors do) waits for it, at most once a step."""

    def __init__(self) -> None:
        self._settle: Callable[[], torch.Tensor] | None = None
        self._count: torch.Tensor | None = None

    def expect(self, settle: Callable[[], torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Arm for a step whose summed count `settle()` waits for and returns; the empty
        tensor returned is what the graph gets as its count, filled on arrival."""
        self._settle, self._count = settle, torch.empty((), dtype=dtype, device=device)
        return self._count

    def settle(self) -> None:
        """Wait for the count (and the step agreement riding with it) unless it is here."""
        if self._settle is not None:
            settle, self._settle = self._settle, None
            self._count.copy_(settle())

    def arrive(self, count: torch.Tensor) -> torch.Tensor:
        """The graph's call: `count` once it holds the step's summed count."""
        if count is self._count:
            self.settle()
        return count


def await_count(gm: fx.GraphModule, arrival: CountArrival) -> fx.GraphModule:
    """Insert `arrival` between `gm`'s count input and its users, in place (module doc);
    a graph without the input is left as it is. Returns `gm`."""
    count = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == COUNT_INPUT), None)
    if count is None or not count.users:
        return gm
    first = next(n for n in gm.graph.nodes if n in count.users)
    with gm.graph.inserting_before(first):
        arrived = gm.graph.call_function(arrival.arrive, (count,), name=ARRIVED)
    arrived.meta.update(count.meta)
    count.replace_all_uses_with(arrived, delete_user_cb=lambda user: user is not arrived)
    gm.recompile()
    return gm
