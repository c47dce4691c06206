"""A buffer made empty and then filled slice by slice, captured as the concatenation it is.

DeepSeek-V3's latent attention builds each key from a per-head part and a rotary part shared
by all heads, by filling an empty tensor (transformers' `modeling_deepseek_v3`):

    new_empty = aten.new_empty(k_pass, [b, heads, s, 16])
    slice_12 = aten.slice(new_empty, 3, 0, 8);    aten.copy_(slice_12, k_nope)
    slice_13 = aten.slice(new_empty, 3, 8, MAX);  aten.copy_(slice_13, k_rot)    # broadcast over heads
    ... sdpa(q, new_empty, v)

Every value lives in the aliasing between the slices and the buffer, which no placement rule
can follow (tensor parallelism splits the heads: the literal `heads` and each slice's view of
it would all need rewriting together). When the slices tile one dim of the buffer exactly and
each is written once, by a `copy_`, before anything reads the buffer, the buffer is

    cat([k_nope.expand(slice 12's shape), k_rot.expand(slice 13's shape)], dim=3)

(a `copy_` broadcasts its source and casts it to the buffer's dtype), with the same values and,
through `expand`'s backward summing over the broadcast dims, the same gradients. Anything else
is left as it is, for the passes to place or refuse.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.ir import meta

aten = torch.ops.aten
_END = 2**63 - 1  # `x[:, 8:]` traced: slice's end is int64's max


def concatenate_filled_buffers(graph: fx.Graph) -> None:
    """Rewrite each buffer filled by slices (module doc) into a `cat`, in place."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (aten.new_empty.default, aten.empty.memory_format):
            if (filled := _filled(node, order)) is not None:
                _concatenate(graph, node, *filled)


Fill = tuple[list[fx.Node], fx.Node, fx.Node]  # (the slices down to the piece, its copy_, the source)


def _filled(buffer: fx.Node, order: dict[fx.Node, int]) -> tuple[int, list[Fill], fx.Node] | None:
    """(dim, fills in order along it, the last copy_) when slices tile one dim of `buffer`,
    each written once by a copy_ before any other read of the buffer; else None."""
    shape = buffer.meta["val"].shape
    slices = [u for u in buffer.users if u.target is aten.slice.Tensor]
    reads = [u for u in buffer.users if u not in slices]
    fills, dims = [], set()
    for first in slices:
        if (fill := _fill(first, shape)) is None:
            return None
        dim, start, end, chain, write = fill
        dims.add(dim)
        fills.append((start, end, (chain, write, write.args[1])))
    if len(dims) != 1:
        return None
    last_write = max((write for _, _, (_, write, _) in fills), key=order.__getitem__)
    if any(order[r] < order[last_write] for r in reads):
        return None
    dim = dims.pop()
    fills.sort(key=operator.itemgetter(0))
    edges = [0] + [end for _, end, _ in fills]
    if any(start != edge for (start, _, _), edge in zip(fills, edges)) or edges[-1] not in (shape[dim], _END):
        return None
    return dim, [fill for _, _, fill in fills], last_write


def _fill(first: fx.Node, shape) -> tuple[int, int, int, list[fx.Node], fx.Node] | None:
    """`buffer[:, :, a:b] = source` traces as a slice per indexed dim, the whole-range ones
    views of all of it: (the dim sliced in part, a, b, the chain of slices, its copy_)."""
    chain, node, part = [], first, None
    while True:
        dim, start, end = (list(node.args[1:]) + [0, 0, _END])[:3]
        dim %= len(shape)
        whole = start == 0 and end in (_END, shape[dim])
        if not whole:
            if part is not None:
                return None  # a block, not a band: more than one dim sliced in part
            part = (dim, start, end)
        chain.append(node)
        users = list(node.users)
        if len(users) != 1:
            return None
        node = users[0]
        if node.target is aten.copy_.default:
            break
        if node.target is not aten.slice.Tensor:
            return None
    if node.args[0] is not chain[-1] or node.users:
        return None
    dim, start, end = part if part is not None else (chain[-1].args[1] % len(shape), 0, _END)
    return dim, start, end, chain, node


def _concatenate(graph: fx.Graph, buffer: fx.Node, dim: int, fills: list[Fill], last_write: fx.Node) -> None:
    dtype = buffer.meta["val"].dtype
    parts = []
    with graph.inserting_before(last_write.next):
        for chain, _, source in fills:
            piece = chain[-1]
            sizes = _expanded_sizes(buffer, dim, piece, source)
            part = source if set(sizes) == {-1} else _call(graph, aten.expand.default, (source, sizes), like=buffer)
            if source.meta["val"].dtype != dtype:
                part = _call(graph, aten._to_copy.default, (part,), like=buffer, dtype=dtype)
            parts.append(part)
        whole = _call(graph, aten.cat.default, (parts, dim), like=buffer)
    firsts = {chain[0] for chain, _, _ in fills}
    buffer.replace_all_uses_with(whole, delete_user_cb=lambda user: user not in firsts)
    for chain, write, _ in fills:
        graph.erase_node(write)
        for piece in reversed(chain):
            graph.erase_node(piece)
    graph.erase_node(buffer)


def _expanded_sizes(buffer: fx.Node, dim: int, piece: fx.Node, source: fx.Node) -> list:
    """`expand`'s sizes taking `source` to `piece`'s shape, as graph arguments: -1 where the
    sizes already agree, else the buffer's own size argument (a node for a symbolic size), and
    the piece's width along the filled dim."""
    sizes = buffer.args[1] if buffer.target is aten.new_empty.default else buffer.args[0]
    have, want = source.meta["val"].shape, piece.meta["val"].shape
    offset = len(want) - len(have)
    expanded = []
    for d, size in enumerate(want):
        if d >= offset and str(have[d - offset]) == str(size):
            expanded.append(-1)
        else:
            expanded.append(int(size) if d == dim else sizes[d])
    return expanded


def _call(graph: fx.Graph, target, args: tuple, *, like: fx.Node, **kwargs) -> fx.Node:
    """A node computing `target(*args, **kwargs)`, its value computed on the inputs' fake values
    (export's), with `like`'s module path and stack."""
    node = graph.call_function(target, args, kwargs)
    meta.copy_export_provenance(node, like)
    values = fx.node.map_arg(args, lambda n: n.meta["val"])
    node.meta["val"] = target(*values, **kwargs)
    return node
