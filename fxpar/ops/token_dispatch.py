"""Rows sent to the ranks that hold their experts, and back: the routed all-to-all.

Under `ep=n` with the all-to-all dispatcher (`passes.expert_parallel`), each rank holds E/n of
a layer's E experts and sends every (token, expert) row it routed to the rank holding that
expert, as Megatron-Core's `MoEAlltoAllTokenDispatcher` and DeepSpeed-MoE do. How many rows
go where is known only once the router ran, so the counts are exchanged first (an equal-split
`fxpar.all_to_all` of the per-expert counts), then the rows move in blocks of those sizes:

    all_to_all_rows(x, sent, received, axis, size) -> rows
        block j of x's rows (sent[j] of them) to rank j of the axis; block j of the result is
        rank j's block for this rank (received[j] rows). Its gradient moves back the same way,
        the splits swapped. `sent` and `received` are int64 counts per rank, read on the host
        when the op runs (a device sync, as every dropless all-to-all dispatcher has).

Nothing is dropped and nothing padded: the rows a rank receives are exactly those routed to
its experts, so the step is one device's. The price is a size the graph cannot know: the fake
kernel, which the activation estimate and the cost model run (`cost.activations`), returns as
many rows as were sent. That is the expected size under uniform routing (each rank's experts
get their share, E/n of the group's rows), and the routed call is predicted at it and matched
without its size (`ir.collectives.Collective.routed`); the counts' exchange is matched in full.
"""

from __future__ import annotations

import torch

from fxpar.errors import BindError
from fxpar.ir.axes import bound
from fxpar.ops.distributed import BY_NAME

OP = BY_NAME["all_to_all_rows"]


@torch.library.custom_op("fxpar::all_to_all_rows", mutates_args=(),
                         schema="(Tensor x, Tensor sent, Tensor received, str axis, int size, "
                                "str phase='forward') -> Tensor")
def all_to_all_rows(x: torch.Tensor, sent: torch.Tensor, received: torch.Tensor, axis: str, size: int,
                    phase: str = "forward") -> torch.Tensor:
    binding = bound(axis)
    if binding.size != size:
        raise BindError(f"an op was compiled for {size} ranks on axis {axis!r}, bound to {binding.size}")
    sent_rows, received_rows = sent.tolist(), received.tolist()
    out = x.new_empty((sum(received_rows), *x.shape[1:]))
    binding.all_to_all(out, x.contiguous(), tag=OP.tag(axis, phase), phase=phase,
                       output_splits=received_rows, input_splits=sent_rows)
    return out


@all_to_all_rows.register_fake
def _(x, sent, received, axis, size, phase="forward"):
    return torch.empty_like(x)  # uniform routing: as many rows come as go (module doc)


def _setup_context(ctx, inputs, output):
    ctx.sent, ctx.received, ctx.axis, ctx.size = inputs[1:5]


def _backward(ctx, grad):
    back = torch.ops.fxpar.all_to_all_rows(grad, ctx.received, ctx.sent, ctx.axis, ctx.size, "backward")
    return back, None, None, None, None, None


all_to_all_rows.register_autograd(_backward, setup_context=_setup_context)
