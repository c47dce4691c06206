"""Which dims an op reads across: what context parallelism must know of every op on tokens.

Under context parallelism (`passes.context_parallel`) each cp rank holds a slice of the
sequence of every activation. An op that computes each output position from the same position
of its inputs (a pointwise op, a linear layer, a norm over the hidden dim, a view that keeps
the tokens apart) runs on the slice as it would on the whole. An op that reads *across* the
sequence (a softmax over keys, a cumulative sum, a shift, a pooling) would read only the
rank's slice, and be silently wrong. `dims_read_across(node)` says which dims of its first
tensor input an op reads across, so the pass can refuse the ones that touch the sequence:

    softmax(x, -1)                 (-1,)        sum(x, [1, 2])             (1, 2)
    slice(x, 1, 0, 8)              (1,)         cat([a, b], 2)             (2,)
    constant_pad_nd(x, [0, 1])     (-1,)        sum(x)                     every dim
    add(x, y), linear(x, w)        ()           an op this table lacks     None (unknown)

Reductions that only *sum* across the sequence (`sum`, a cross entropy with reduction="sum")
are what a loss is made of; `SUMS` names them: their output is a partial sum over the cp ranks,
which the runtime completes as it completes data parallelism's.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.ops.distributed import distributed_op

aten = torch.ops.aten
EVERY_DIM = "every"

# Ops that read no dim across: views and copies keep each position apart; factories make new
# values; matmuls are judged by their operands, not here (`passes.context_parallel`).
_ALONG_NOTHING = {
    aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.permute, aten.transpose,
    aten.t, aten.unsqueeze, aten.squeeze, aten.flatten, aten.unflatten, aten.contiguous,
    aten.clone, aten.alias, aten.detach, aten._to_copy, aten.to, aten.lift_fresh_copy,
    aten.linear, aten.mm, aten.addmm, aten.bmm, aten.matmul, aten.baddbmm, aten.embedding,
    aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.zeros_like, aten.ones_like,
    aten.empty_like, aten.full_like, aten.scalar_tensor, aten.expand_as, aten.view_as,
    aten.type_as, aten.copy, aten.masked_fill, aten.where, aten.fill, aten.repeat_interleave,
    aten.dropout, aten.native_dropout,  # elementwise; whether they draw is `pass_list`'s refusal
    aten.view_as_complex, aten.view_as_real,  # the last dim's (real, imaginary) pairs: rotary's
    aten.stack,  # side by side along a new dim: element i of the output is input i's
}
# (op, index of its dim argument, default when absent)
_ALONG_ONE_DIM = {
    aten.softmax: 1, aten._softmax: 1, aten.log_softmax: 1, aten._log_softmax: 1, aten.cumsum: 1,
    aten.cumprod: 1, aten.slice: 1, aten.select: 1, aten.narrow: 1, aten.index_select: 1,
    aten.gather: 1, aten.scatter: 1, aten.scatter_: 1, aten.scatter_add: 1, aten.diff: 1, aten.cat: 1, aten.split: 2,
    aten.split_with_sizes: 2, aten.chunk: 2, aten.unbind: 1, aten.argmax: 1, aten.argmin: 1,
    aten.unfold: 1, aten.topk: 2, aten.sort: 1, aten.argsort: 1,
}
_ALONG_DIM_LIST = {
    aten.sum: 1, aten.mean: 1, aten.amax: 1, aten.amin: 1, aten.var: 1, aten.std: 1,
    aten.var_mean: 1, aten.logsumexp: 1, aten.any: 1, aten.all: 1, aten.max: 1, aten.min: 1,
    aten.prod: 1, aten.norm: 2, aten.linalg_vector_norm: 2, aten.flip: 1, aten.roll: 2,
}
_NORMS = {aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm}
_LOSSES = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d}
_SUM = 2  # torch's reduction enum: 0 none, 1 mean, 2 sum
_DEFAULT_DIM = {aten.cat: 0, aten.split: 0, aten.split_with_sizes: 0, aten.chunk: 0,
                aten.unbind: 0, aten.cumsum: None, aten.topk: -1, aten.sort: -1, aten.argsort: -1}


def packet(node: fx.Node):
    """The op's overload packet (`aten.sum` for `aten.sum.dim_IntList`), or the callable."""
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


def first_tensor(node: fx.Node) -> fx.Node | None:
    """The op's first tensor input (the first of a list for cat and stack)."""
    first = node.args[0] if node.args else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return first if isinstance(first, fx.Node) else None


def dims_read_across(node: fx.Node) -> tuple[int, ...] | str | None:
    """The dims of the op's first tensor input it reads across, non-negative; EVERY_DIM for a
    reduction of the whole value; None when this table does not know the op (module doc)."""
    op, source = packet(node), first_tensor(node)
    ndim = source.meta["val"].dim() if source is not None and hasattr(source.meta.get("val"), "dim") else 0
    if op is operator.getitem or op in _ALONG_NOTHING or _whole_slice(node):
        return ()
    if getattr(node.target, "namespace", None) == "fxpar":  # another axis' collective
        moved = distributed_op(node)
        return (node.args[3] % max(ndim, 1),) if moved is not None and moved.takes_dim else ()
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        return ()
    if op in _LOSSES:
        return EVERY_DIM if _argument(node, 3, "reduction", 1) else ()
    if op in _NORMS:  # over the last len(normalized_shape) dims
        return tuple(range(ndim - len(_argument(node, 1, "normalized_shape", ())), ndim))
    if op is aten.constant_pad_nd or op is aten.pad:
        pads = _argument(node, 1, "pad", [])
        return tuple(ndim - 1 - i for i in range(len(pads) // 2) if pads[2 * i] or pads[2 * i + 1])
    if op is aten.index:
        return tuple(d for d, index in enumerate(_argument(node, 1, "indices", [])) if index is not None)
    if op in _ALONG_ONE_DIM:
        dim = _argument(node, _ALONG_ONE_DIM[op], "dim", _DEFAULT_DIM.get(op))
        return EVERY_DIM if dim is None else (dim % max(ndim, 1),)
    if op in _ALONG_DIM_LIST:
        dims = _argument(node, _ALONG_DIM_LIST[op], "dim", None)
        if dims is None or dims == []:
            return EVERY_DIM
        dims = [dims] if isinstance(dims, int) else dims
        return tuple(sorted({d % max(ndim, 1) for d in dims}))
    return None


def _whole_slice(node: fx.Node) -> bool:
    """`x[:, :]`: a slice from the start to the end, step 1, which exported code is full of."""
    if packet(node) is not aten.slice:
        return False
    start, end, step = (_argument(node, i, name, default) for i, name, default in
                        ((2, "start", None), (3, "end", None), (4, "step", 1)))
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= 2**62)) and step == 1


def sums_across(node: fx.Node) -> bool:
    """Whether the op reduces by summing (`sum`, a loss with reduction="sum"): its output is a
    partial sum when its input holds a slice of the dims it reads across."""
    op = packet(node)
    if op in _LOSSES:
        return _argument(node, 3, "reduction", 1) == _SUM
    return op is aten.sum


def _argument(node: fx.Node, index: int, name: str, default):
    """Argument `index` of the call, or keyword `name`, or `default`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)
