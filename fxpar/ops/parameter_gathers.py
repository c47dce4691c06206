"""ZeRO-3's collective: a layer's parameter shards gathered whole, their gradients reduce-scattered.

Under `zero=3` each rank stores one flat piece of every trained parameter (the dp axis's
`FlatShard` placement: the tensor-parallel piece flattened, zero-padded to a multiple of dp,
cut in dp equal pieces; Rajbhandari et al. 2020, Sec. 5.3, P_os+g+p). The ZeRO-3 pass
(`passes.zero3`) puts one op before each layer's first use, over all its parameters:

    wq, wk, ... = torch.ops.fxpar.gather_parameters.default([wq_shard, wk_shard, ...], 'dp', 2)
    h_0_attn_q_weight = torch.ops.aten.view.default(torch.ops.aten.narrow(wq, 0, 0, n), shape)

Forward: the shards are laid side by side in one flat buffer (FSDP2's copy-in) and
all-gathered in one call; each parameter's padded flat value is copied out of every rank's
block. Backward: the reverse, one reduce-scatter of the layer's gradients laid out the same
way, which leaves each rank the summed gradient of its own shards (as registered here,
autograd accumulates them; the runtime's eager form leaves the call in flight under the
backward of the layers below and sets them itself: `runtime.state.parameter_gatherer`). So each
layer costs one all-gather in forward and one reduce-scatter in backward, per microbatch,
and both are in the graph, where `lowering.graph_calls` reads them: the step program lists
them like any tensor-parallel op's calls. (With several
microbatches the reduce-scatter may instead go out once per step, in the last backward, on
the sum of the step's whole gradients: `fxpar.plan.zero_reduction`.)

The gathered parameters are ordinary graph values: they are freed after their last use in
forward unless autograd saves them for backward (a linear keeps its weight). With
`reshard_after_forward=true` the pass also puts a `regather_parameters` op on the output of
each layer's last use but the root layer's (`passes.zero3`): its backward gathers the layer again, and the runtime
(`runtime.state.parameter_gatherer`) hands backward those values where autograd saved the
forward's, so a layer's whole weights live only while its forward or backward runs.

Two dtypes (FSDP2's `param_dtype` and `reduce_dtype`): with `dtype`, the pieces are cast to
it as they are laid out, so the gather moves and returns `dtype` (bf16-mixed's bf16), while
the gradients are cast to the pieces' own dtype before the reduce-scatter, which sums them
in it (fp32 pieces: `reduce_dtype=fp32`) and hands each piece its gradient in its dtype.
Without `dtype` both run in the pieces' dtype. `DistributedOp.payload_dtype` says the same
to lowering.
"""

from __future__ import annotations

import torch

from fxpar.errors import BindError
from fxpar.ir.axes import bound
from fxpar.ops.distributed import BY_NAME

OP = BY_NAME["gather_parameters"]
REGATHER = BY_NAME["regather_parameters"]


def _binding(axis: str, size: int):
    binding = bound(axis)
    if binding.size != size:
        raise BindError(f"a ZeRO-3 gather was compiled for {size} ranks on axis {axis!r}, bound to {binding.size}")
    return binding


def laid_out(shards: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's pieces side by side, in `dtype` (default theirs): what a layer's gather
    sends (FSDP2's copy-in; a cast is done by the copy, no second buffer)."""
    if dtype is None or dtype == shards[0].dtype:
        return torch.cat([s.detach().reshape(-1) for s in shards])
    flat = shards[0].new_empty(sum(s.numel() for s in shards), dtype=dtype)
    for piece, s in zip(flat.split([s.numel() for s in shards]), shards):
        piece.copy_(s.detach().reshape(-1))
    return flat


def whole_values(gathered: torch.Tensor, widths: list[int], size: int) -> list[torch.Tensor]:
    """Each parameter's whole flat value out of every rank's `laid_out` block (the copy-out):
    the concatenation of its pieces in rank order."""
    blocks = gathered.view(size, sum(widths)).split(widths, dim=1)
    return [block.reshape(-1) for block in blocks]


def gather(shards: list[torch.Tensor], axis: str, size: int, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Every rank's `shards`, whole, in `dtype` (default theirs): for each, the concatenation
    of its pieces in rank order. Run by autograd's engine it is a compiled backward's
    recomputation of the gather (`ops.recomputed_gathers`): the step program's re-gather."""
    flat = laid_out(shards, dtype)
    out = flat.new_empty(size * flat.numel())
    if torch._C._current_graph_task_id() == -1:
        tag, phase = OP.tag(axis, "forward"), "forward"
    else:
        tag, phase = REGATHER.tag(axis, "backward"), "backward"
    _binding(axis, size).all_gather(out, flat, tag=tag, phase=phase)
    return whole_values(out, [s.numel() for s in shards], size)


def reduce_scatter(grads: list[torch.Tensor | None], widths: list[int], like: torch.Tensor, axis: str,
                   size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum over ranks of each whole gradient, in `dtype` (default `like`'s: the pieces'
    dtype), this rank's piece of each side by side in one flat tensor (`gather`'s dual). The
    gradients are cast as they are laid out, so the sum runs in `dtype`."""
    return scattered(laid_out_gradients(grads, widths, like, size, dtype), axis, size)


def laid_out_gradients(grads: list[torch.Tensor | None], widths: list[int], like: torch.Tensor, size: int,
                       dtype: torch.dtype | None = None, *, into: torch.Tensor | None = None) -> torch.Tensor:
    """The whole gradients as the reduce-scatter sends them, a (size, sum(widths)) tensor
    whose row r holds rank r's pieces, in `dtype` (default `like`'s); added to `into` when
    given (the step's earlier microbatches', summed before one reduce-scatter:
    `fxpar.plan.zero_reduction`)."""
    stacked = into if into is not None else like.new_empty((size, sum(widths)), dtype=dtype or like.dtype)
    for block, g, w in zip(stacked.split(widths, dim=1), grads, widths):
        if g is not None:
            (block.add_ if into is not None else block.copy_)(g.reshape(size, w))
        elif into is None:
            block.zero_()
    return stacked


def scattered(stacked: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    """`laid_out_gradients` summed over the ranks of `axis`: this rank's row of the sum."""
    out = stacked.new_empty(stacked.shape[1])
    _binding(axis, size).reduce_scatter(out, stacked.reshape(-1), tag=OP.tag(axis, "backward"), phase="backward")
    return out


@torch.library.custom_op("fxpar::gather_parameters", mutates_args=(),
                         schema="(Tensor[] shards, str axis, int size, *, ScalarType? dtype=None) -> Tensor[]")
def _gather_parameters(shards, axis, size, *, dtype=None):
    return gather(list(shards), axis, size, dtype)


@_gather_parameters.register_fake
def _(shards, axis, size, *, dtype=None):
    return [s.new_empty(s.numel() * size, dtype=dtype or s.dtype) for s in shards]


@torch.library.custom_op("fxpar::scatter_parameter_gradients", mutates_args=(),
                         schema="(Tensor?[] grads, int[] widths, Tensor like, str axis, int size, "
                                "*, ScalarType? dtype=None) -> Tensor")
def _scatter_gradients(grads, widths, like, axis, size, *, dtype=None):
    """gather_parameters' backward, itself an op so that a traced backward keeps it."""
    return reduce_scatter(list(grads), list(widths), like, axis, size, dtype)


@_scatter_gradients.register_fake
def _(grads, widths, like, axis, size, *, dtype=None):
    return like.new_empty(sum(widths), dtype=dtype or like.dtype)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    shards, ctx.axis, ctx.size = inputs
    ctx.widths = [s.numel() for s in shards]
    ctx.shapes = [s.shape for s in shards]
    ctx.dtype = shards[0].dtype  # the gradients are summed in the pieces' dtype


def _backward(ctx, grads):
    flat = torch.ops.fxpar.scatter_parameter_gradients(list(grads), ctx.widths, _like(grads), ctx.axis, ctx.size,
                                                       dtype=ctx.dtype)
    return [p.view(shape) for p, shape in zip(flat.split(ctx.widths), ctx.shapes)], None, None


def _like(grads) -> torch.Tensor:
    return next(g for g in grads if g is not None)


_gather_parameters.register_autograd(_backward, setup_context=_setup_context)


# -- gathering again for backward (reshard_after_forward) -----------------------------------------


@torch.library.custom_op("fxpar::regather_parameters", mutates_args=(),
                         schema="(Tensor x, Tensor[] shards, str axis, int size, *, ScalarType? dtype=None) -> Tensor")
def _regather_parameters(x, shards, axis, size, *, dtype=None):
    """Identity on `x`, the output of the layer's last use of its gathered parameters: its
    backward, which autograd runs before that of any of the layer's ops, is where the layer's
    parameters are gathered again for what backward reads of them."""
    return x.clone()


@_regather_parameters.register_fake
def _(x, shards, axis, size, *, dtype=None):
    return torch.empty_like(x)


def _regather_setup(ctx, inputs, keyword_only_inputs, output):
    _, ctx.shards, ctx.axis, ctx.size = inputs
    ctx.dtype = keyword_only_inputs["dtype"]


def _regather_backward(ctx, grad):
    # As registered (torch.compile, tracing), the gather is issued, so every rank's calls are
    # the step program's; the runtime's eager form (`runtime.state.parameter_gatherer`) keeps what it
    # gathers for the saved tensors that name it.
    flat = laid_out(ctx.shards, ctx.dtype)
    _binding(ctx.axis, ctx.size).all_gather(flat.new_empty(ctx.size * flat.numel()), flat,
                                            tag=REGATHER.tag(ctx.axis, "backward"), phase="backward")
    return grad, [None] * len(ctx.shards), None, None


_regather_parameters.register_autograd(_regather_backward, setup_context=_regather_setup)
