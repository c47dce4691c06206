"""The random ops of a rank module: every value the graph draws, drawn from its own stream.

`passes.random_draws` replaces what torch.export captures (`aten.dropout`, `aten.rand_like`,
`aten.randn_like`, `aten.bernoulli`, and `scaled_dot_product_attention`'s dropout) with these
ops, in the `fxpar` namespace, which draw from a generator seeded by `fxpar.ops.random_streams`
instead of the process's global one:

    random_like(like, distribution, p, op_index, exact, dp_dim, dp_size, microbatches,
                tp_dim, tp_parts, tp_size) -> Tensor
        a tensor shaped as `like` (which only lends its shape, dtype and device): "dropout"
        (the kept elements' scale 1/(1-p), the others 0: dropout is `x * mask`), "bernoulli"
        (1 where a uniform draw < like), "bernoulli_p" (1 with probability p), "uniform"
        (rand_like) or "normal" (randn_like)
    attention_dropout_mask(query, key, p, op_index, exact, ...) -> Tensor (bool)
        which attention probabilities (batch, heads, s_q, s_k) dropout keeps
    attention_with_dropout_mask(query, key, value, attn_mask, p, is_causal, mask, scale,
                                enable_gqa) -> Tensor
        scaled-dot-product attention whose dropout keeps `mask` (torch's math kernel, written
        out; its gradient is the math's, by decomposition)

The slice arguments say how the value lies across the mesh, read from its placement at compile
time: `dp_dim` is the dim data parallelism (and the microbatches) split, `tp_dim` the dim
tensor parallelism splits into `tp_parts` blocks (-1 where the axis does not split it), and the
degrees. In the rank's code:

    detach = torch.ops.aten.detach.default(linear_3)
    random_like = torch.ops.fxpar.random_like.default(detach, 'dropout', 0.1, 2, False, 0, 2, 1, -1, 1, 2)
    mul = torch.ops.aten.mul.Tensor(linear_3, random_like)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxpar.ir.axes import bound
from fxpar.ir.placement import Placements, Shard, local_slice
from fxpar.ops.random_streams import bound_random, stream_seed

DISTRIBUTIONS = ("dropout", "bernoulli", "bernoulli_p", "uniform", "normal")
_SLICE = "int dp_dim, int dp_size, int microbatches, int tp_dim, int tp_parts, int tp_size"


@dataclass(frozen=True)
class DrawSlice:
    """How a drawn value lies across the mesh (the ops' slice arguments, module doc)."""

    dp_dim: int = -1
    dp_size: int = 1
    microbatches: int = 1
    tp_dim: int = -1
    tp_parts: int = 1
    tp_size: int = 1

    @property
    def args(self) -> tuple[int, ...]:
        return (self.dp_dim, self.dp_size, self.microbatches, self.tp_dim, self.tp_parts, self.tp_size)

    @property
    def whole_factor(self) -> int:
        """How many times this rank's piece the whole value is (what rng=exact draws)."""
        batch = self.dp_size * self.microbatches if self.dp_dim >= 0 else 1
        return batch * (self.tp_size if self.tp_dim >= 0 else 1)

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on each axis that splits the value."""
        return {axis: bound(axis).index for axis, dim, size in
                (("dp", self.dp_dim, self.dp_size), ("tp", self.tp_dim, self.tp_size)) if dim >= 0 and size > 1}

    def generator_seed(self, op_index: int, exact: bool) -> int:
        """The seed of this op's generator on this rank (`random_streams.stream_seed`). A
        value nothing splits is drawn whole under either mode, so one device draws the same
        masks with rng=fast as with rng=exact."""
        stream = bound_random()
        if exact or self.whole_factor == 1:
            return stream_seed(stream.seed, stream.step, op_index)
        microbatch = stream.microbatch if self.dp_dim >= 0 and self.microbatches > 1 else None
        return stream_seed(stream.seed, stream.step, op_index, microbatch=microbatch, coords=self.coords())

    def whole_shape(self, shape: torch.Size) -> list[int]:
        shape = list(shape)
        if self.dp_dim >= 0:
            shape[self.dp_dim] *= self.dp_size * self.microbatches
        if self.tp_dim >= 0:
            shape[self.tp_dim] *= self.tp_size
        return shape

    def piece(self, whole: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """This rank's slice of the `whole` value (of microbatch `stream.microbatch`):
        data-parallel replicas hold consecutive blocks of the batch and each splits its block
        into consecutive microbatches (`Runner.local_batch`, then `Runner.step`)."""
        if self.dp_dim >= 0:
            index = _index("dp", self.dp_size) * self.microbatches + bound_random().microbatch
            length = shape[self.dp_dim]
            whole = whole.narrow(self.dp_dim, index * length, length)
        if self.tp_dim >= 0 and self.tp_size > 1:
            placements = Placements(tp=Shard(self.tp_dim, self.tp_parts))
            whole = local_slice(whole, placements, {"tp": _index("tp", self.tp_size)}, {"tp": self.tp_size})
        return whole.contiguous()


def _index(axis: str, size: int) -> int:
    return bound(axis).index if size > 1 else 0


def draw_uniform(shape: torch.Size, device: torch.device, op_index: int, exact: bool, where: DrawSlice,
                 *, normal: bool = False) -> torch.Tensor:
    """This rank's piece (of `shape`) of op `op_index`'s uniform (or normal) fp32 draw."""
    generator = torch.Generator(device=device)
    generator.manual_seed(where.generator_seed(op_index, exact))
    drawn_shape = where.whole_shape(shape) if exact else list(shape)
    draw = torch.randn if normal else torch.rand
    values = draw(drawn_shape, generator=generator, device=device, dtype=torch.float32)
    return where.piece(values, shape) if exact else values


@torch.library.custom_op("fxpar::random_like", mutates_args=(),
                         schema=f"(Tensor like, str distribution, float p, int op_index, bool exact, {_SLICE}) -> Tensor")
def random_like(like, distribution, p, op_index, exact, *slice_args):
    where = DrawSlice(*slice_args)
    values = draw_uniform(like.shape, like.device, op_index, exact, where, normal=distribution == "normal")
    if distribution == "dropout":
        return (values < 1 - p).to(like.dtype) * (1 / (1 - p))
    if distribution == "bernoulli":
        return (values < like).to(like.dtype)
    if distribution == "bernoulli_p":
        return (values < p).to(like.dtype)
    return values.to(like.dtype)


@random_like.register_fake
def _(like, distribution, p, op_index, exact, *slice_args):
    return torch.empty_like(like)


def attention_shape(query: torch.Tensor, key: torch.Tensor) -> tuple:
    """The shape of attention's probabilities: (*query's leading dims, s_q, s_k)."""
    return (*query.shape[:-1], key.shape[-2])


@torch.library.custom_op("fxpar::attention_dropout_mask", mutates_args=(),
                         schema=f"(Tensor query, Tensor key, float p, int op_index, bool exact, {_SLICE}) -> Tensor")
def attention_dropout_mask(query, key, p, op_index, exact, *slice_args):
    shape = torch.Size(attention_shape(query, key))
    return draw_uniform(shape, query.device, op_index, exact, DrawSlice(*slice_args)) < 1 - p


@attention_dropout_mask.register_fake
def _(query, key, p, op_index, exact, *slice_args):
    return query.new_empty(attention_shape(query, key), dtype=torch.bool)


_library = torch.library.Library("fxpar", "FRAGMENT")
_library.define(
    "attention_with_dropout_mask(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float p, "
    "bool is_causal, Tensor mask, float? scale, bool enable_gqa) -> Tensor"
)


def _attention_with_dropout_mask(query, key, value, attn_mask, p, is_causal, mask, scale, enable_gqa):
    """torch's math kernel for scaled-dot-product attention (`_scaled_dot_product_attention_math`),
    with dropout keeping `mask`. Written out rather than called, since that kernel warns that
    a mask is for testing, which here it is not."""
    length, source = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    root = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.shape[-1]))
    scores = (query * root) @ (key.transpose(-2, -1) * root)
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(causal.logical_not(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    probabilities = torch.softmax(scores, dim=-1).masked_fill(mask.logical_not(), 0)
    return probabilities @ (value * (1 / (1 - p)))


# Composite: autograd and fake tensors go through the math's own aten ops.
_library.impl("attention_with_dropout_mask", _attention_with_dropout_mask, "CompositeImplicitAutograd")
