"""Projections: an activation times a weight matrix, in every form torch.export emits.

Tensor parallelism splits projections (Shoeybi et al. 2019, Sec. 3), and a captured graph
spells them four ways:

    form                          weight     out_dim   comes from
    aten.linear(x, w, b)          (out, in)  0         nn.Linear, F.linear
    aten.addmm(b, x2d, w)         (in, out)  1         Hugging Face GPT-2's Conv1D:
                                                       addmm(bias, x.view(-1, in), weight)
    aten.mm(x2d, w)               (in, out)  1         the same without a bias
    aten.matmul(x, w)             (in, out)  1         `x @ w` with a parameter `w`

A `Projection` names the parts of any of them alike, so the plan rules (`rules`, the plan's `tp_rules`), the
propagation table (`propagation.RULES`) and the rewrite (`rewrite`) each handle one
shape of problem instead of four: column-parallel splits the weight's `out_dim`
(`Shard(out_dim)`, and the bias with it), row-parallel its `in_dim` (`Shard(in_dim)`, the bias
added once after the sum).

    %view_1 = aten.reshape(%ln, [-1, 64])
    %addmm = aten.addmm(%c_attn_bias, %view_1, %c_attn_weight)
    projection_of(addmm) == Projection(node=addmm, x=view_1, weight=c_attn_weight,
                                       bias=c_attn_bias, out_dim=1)

For addmm, mm and matmul only a parameter in the weight's place makes a projection: the same
ops between two activations are attention's `q @ k^T` and `p @ v`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ops.expert_routing import is_grouped_mm

aten = torch.ops.aten

# Views after which the last dim is still the projection's output features: (B*T, 3C) -> (B, T, 3C).
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape}
_SPLITS = {aten.split, aten.split_with_sizes, aten.chunk}


@dataclass(frozen=True)
class Projection:
    """`x @ W (+ b)` as the graph computes it at `node`; see the module doc for `out_dim`."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    out_dim: int  # the weight dim that holds the output features

    @property
    def in_dim(self) -> int:
        """The weight dim contracted with the input's last dim."""
        return 1 - self.out_dim

    @property
    def weight_name(self) -> str | None:
        """The weight's parameter name, or None for a computed weight."""
        return meta.parameter_name(self.weight)


def packet(node: fx.Node):
    """The op of a call node without its overload: aten.addmm for aten.addmm.default."""
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target


def is_parameter(node: object) -> bool:
    return isinstance(node, fx.Node) and meta.parameter_name(node) is not None


def _is_matrix_parameter(node: object) -> bool:
    return is_parameter(node) and node.meta["val"].dim() == 2


def projection_of(node: fx.Node) -> Projection | None:
    """The projection `node` computes, or None (see the table in the module doc)."""
    if node.op != "call_function":
        return None
    op = packet(node)
    if op is aten.linear and isinstance(node.args[1], fx.Node):
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return Projection(node=node, x=node.args[0], weight=node.args[1], bias=bias, out_dim=0)
    if op is aten.addmm and _is_matrix_parameter(node.args[2]) and _unscaled(node):
        return Projection(node=node, x=node.args[1], weight=node.args[2], bias=node.args[0], out_dim=1)
    if op in (aten.mm, aten.matmul) and _is_matrix_parameter(node.args[1]):
        return Projection(node=node, x=node.args[0], weight=node.args[1], bias=None, out_dim=1)
    return None


def _unscaled(addmm: fx.Node) -> bool:
    """addmm(b, x, w, beta=1, alpha=1): scaled forms are not plain projections."""
    beta = addmm.args[3] if len(addmm.args) > 3 else addmm.kwargs.get("beta", 1)
    alpha = addmm.args[4] if len(addmm.args) > 4 else addmm.kwargs.get("alpha", 1)
    return beta == 1 and alpha == 1


def projections(graph: fx.Graph) -> list[Projection]:
    """Every projection of `graph`, in graph order."""
    return [p for node in graph.nodes if (p := projection_of(node)) is not None]


@dataclass(frozen=True)
class GroupedProjection:
    """A mixture of experts' `grouped_mm(rows, W, offsets)` (`ops.expert_routing.is_grouped_mm`):
    each expert's rows times its matrix of the 3D weight operand (experts, in, out). `parameter`
    is the expert weights the operand is (`transposed`: a (experts, out, in) parameter, as
    transformers stores them, seen through `transpose(-2, -1)`)."""

    node: fx.Node
    parameter: fx.Node
    transposed: bool

    @property
    def out_dim(self) -> int:
        """The parameter's dim of the output features (in_dim: the other of 1 and 2)."""
        return 1 if self.transposed else 2


def grouped_projection_of(node: fx.Node) -> GroupedProjection | None:
    """The grouped projection `node` computes with a 3D parameter, or None."""
    if not is_grouped_mm(node):
        return None
    operand = node.args[1]
    if is_parameter(operand) and operand.meta["val"].dim() == 3:
        return GroupedProjection(node, operand, transposed=False)
    if (packet(operand) is aten.transpose and is_parameter(operand.args[0]) and operand.args[0].meta["val"].dim() == 3
            and sorted(d % 3 for d in operand.args[1:3]) == [1, 2]):
        return GroupedProjection(node, operand.args[0], transposed=True)
    return None


def fused_projections(gm: fx.GraphModule) -> dict[str, int | tuple[int, ...]]:
    """Parameters of projections whose output the graph cuts into blocks: {name: blocks}, a
    count of equal blocks or the relative widths of unequal ones (`placement.Shard.parts`).

    GPT-2's `c_attn` computes q|k|v in one matmul and splits the last dim in three (HF's
    Conv1D first views (B*T, 3C) back to (B, T, 3C)). Cutting its weight into tp contiguous
    slices would give rank 0 all of q; as `Shard(out_dim, parts=3)` each rank holds its own
    slice of each block, so the local output splits into local q, k and v heads. Phi-3's
    grouped-query `qkv_proj` is sliced into 4 query heads, 2 key and 2 value heads: widths
    (2, 1, 1), each rank its slice of each.

    A split after a view that cuts the last dim is no fused projection: GPT-NeoX views its
    `query_key_value` output as (B, T, heads, 3 * head_dim) and chunks each head, so its rows
    are head-major and a plain `Shard(0)` already gives each rank whole heads.
    """
    fused = {}
    for projection in projections(gm.graph):
        blocks = _blocks_of_last_dim(projection.node)
        if blocks is None:
            continue
        for parameter in (projection.weight, projection.bias):
            if is_parameter(parameter):
                fused[meta.parameter_name(parameter)] = blocks
    for node in gm.graph.nodes:  # an expert's gate|up, cut in two after the grouped matmul
        if (grouped := grouped_projection_of(node)) is not None and (blocks := _blocks_of_last_dim(node)) is not None:
            fused[meta.parameter_name(grouped.parameter)] = blocks
    return fused


def _blocks_of_last_dim(node: fx.Node) -> int | tuple[int, ...] | None:
    width = node.meta["val"].shape[-1]
    if not isinstance(width, int):
        return None
    users = _through_last_dim_views(node)
    for user in users:
        op = packet(user)
        if op not in _SPLITS or not _on_last_dim(user, _split_dim(user)):
            continue
        size = user.args[1]
        if op is aten.chunk:
            return int(size)
        if isinstance(size, (list, tuple)):
            return _widths(size) if all(isinstance(n, int) for n in size) and sum(size) == width else None
        if isinstance(size, int) and width % size == 0:
            return int(width // size)
    slicing = [user for user in users if packet(user) is aten.slice]
    bounds = [slice_bounds(user, width) for user in slicing]
    if len(slicing) > 1 and all(b is not None and _on_last_dim(u, b[0]) for u, b in zip(slicing, bounds)):
        pieces = sorted((start, stop) for _, start, stop in bounds)
        if pieces[0][0] == 0 and pieces[-1][1] == width and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])):
            return _widths([stop - start for start, stop in pieces])
    return None


def _on_last_dim(node: fx.Node, dim) -> bool:
    rank = len(node.args[0].meta["val"].shape)
    return isinstance(dim, int) and dim % rank == rank - 1


def _split_dim(node: fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)


def slice_bounds(node: fx.Node, width: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of an aten.slice with step 1 and constant, non-negative bounds (stop
    clipped to `width`, the size of the sliced dim), else None: what a fused projection's
    blocks are cut by (`fused_projections`, `view_rules.one_block`)."""
    if packet(node) is not aten.slice:
        return None
    dim, start, stop, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    start, stop = start or 0, width if stop is None else stop
    if step != 1 or not isinstance(dim, int) or not all(isinstance(v, int) and v >= 0 for v in (start, stop)):
        return None
    return dim, min(start, width), min(stop, width)


def _widths(sizes) -> int | tuple[int, ...]:
    """Block sizes as `Shard.parts`: their count when equal, else their relative widths."""
    if len(set(sizes)) == 1:
        return len(sizes)
    divisor = math.gcd(*sizes)
    return tuple(size // divisor for size in sizes)


def _through_last_dim_views(node: fx.Node) -> list[fx.Node]:
    """`node`'s users, and theirs through views that keep the last dim whole."""
    found, stack = [], list(node.users)
    width = node.meta["val"].shape[-1]
    while stack:
        user = stack.pop()
        found.append(user)
        if packet(user) in _VIEWS and _same_size(user.meta["val"].shape[-1], width):
            stack.extend(user.users)
    return found


def _same_size(a: object, b: object) -> bool:
    """Equal static sizes; never compares symbolic ones (that would specialise them)."""
    return isinstance(a, int) and isinstance(b, int) and a == b
