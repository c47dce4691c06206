"""Compute rules: FLOPs and bytes of each aten op, one table keyed by op, one rule a line.

Conventions (they decide what an MFU figure means, so they are stated, not implied):

* a matmul-like op costs 2mnk FLOPs: one multiply and one add per term (`linear`, `mm`,
  `addmm`, `bmm`, `matmul`, `baddbmm`, and a grouped matmul over experts, m its rows); a bias
  add is counted under `other`;
* `scaled_dot_product_attention` costs 4 x batch x heads x s_q x s_k x head_dim forward
  (QK^T and attention x V), with no causal discount: the convention of Megatron-LM and of
  Korthikanti et al. 2022, so MFU figures compare with theirs. These FLOPs count as matmul
  FLOPs (MFU needs them there) and again as `attention_flops`, because an attention kernel
  runs well below the matmul rate (`Hardware.attention_efficiency`);
* elementwise, norm, softmax and loss ops cost a few FLOPs per element (`_PER_ELEMENT`);
* views, shape queries and metadata ops are free;
* copies and creations cost bytes, no FLOPs, and so do comparisons, logical ops, `diff` and
  `cumsum` on integer and boolean tensors: the masks and position ids of Hugging Face models;
* backward costs 2x forward for every op (Narayanan et al. 2021, appendix), so a training
  step is 3x the forward FLOPs;
* bytes are the sizes of the op's tensor inputs and output: what it reads and writes once.

An op with no rule is not silently free: `cost_of` returns its bytes as a memory-bound cost
with `costed=False`, and the estimate lists it under `uncosted`.

Besides FLOPs and bytes every op pays a fixed overhead (`Hardware.op_overhead`), once in the
forward and once per node of the backward graph; `op_counts` counts both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from fxpar.cost.matmul_table import matmul_shapes
from fxpar.ir import meta
from fxpar.ops.deferred_linear import stands_for
from fxpar.ops.distributed import distributed_op
from fxpar.ops.expert_routing import is_grouped_mm
import fxpar.ops.chunked_loss  # noqa: F401  (registers torch.ops.fxpar.chunked_cross_entropy)
import fxpar.ops.random_ops
import fxpar.ops.vocab_parallel  # noqa: F401  (the torch.ops.fxpar lookups priced below)

aten = torch.ops.aten
Shape = tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class OpCost:
    """Forward cost of one node: matmul FLOPs, other FLOPs, bytes read plus written."""

    matmul_flops: sympy.Expr
    other_flops: sympy.Expr
    bytes: sympy.Expr
    costed: bool = True
    attention_flops: sympy.Expr = sympy.Integer(0)  # the part of matmul_flops in attention
    kind: str = "pointwise"  # which bandwidth its bytes move at (`BYTE_KINDS`)
    # A dense matmul's (m, k, n), its batch dims folded into m: 2 m k n = matmul_flops. What
    # a rate table prices it, and its backward's two matmuls, by (`cost.matmul_table`).
    shape: Shape | None = None


def _numel(shape: Shape) -> sympy.Expr:
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def _linear(inputs: list[Shape], out: Shape, args) -> tuple:
    x, w = inputs[0], inputs[1]
    rows = _numel(x[:-1])
    bias = rows * w[0] if len(inputs) > 2 else 0
    return 2 * rows * x[-1] * w[0], bias


def _mm(inputs, out, args) -> tuple:
    a = inputs[-2]  # (..., m, k) @ (..., k, n): 2 m n k per output batch
    extra = _numel(out) if len(inputs) == 3 else 0  # addmm / baddbmm add their input
    return 2 * _numel(out) * a[-1], extra


def _matmul(inputs, out, args) -> tuple:
    a = inputs[0]
    return 2 * _numel(out) * a[-1], 0


def _dense_shape(packet, inputs: list[Shape], out: Shape) -> Shape:
    """(m, k, n) of a dense matmul-like op: k the reduced size, n the output's last size, m
    the rest of the output (rows, and any batch dims)."""
    if packet is aten.linear:
        x, w = inputs[0], inputs[1]
        return _numel(x[:-1]), x[-1], w[0]
    a = inputs[0] if packet is aten.matmul else inputs[-2]  # addmm, baddbmm: (input, a, b)
    n = out[-1] if len(out) >= 1 and len(inputs[-1]) >= 2 else sympy.Integer(1)
    return sympy.cancel(_numel(out) / n), a[-1], n


def dense_gradients(node: fx.Node, shape: Shape, needs_gradient: Callable[[object], bool]) -> list[Shape]:
    """The matmuls the backward of the dense matmul `node` of forward `shape` runs: the
    gradient of its operand A (m x k; `matmul_shapes`' input gradient) and of B (k x n, a
    linear's weight: its weight gradient), each where `needs_gradient(operand)`. A first
    layer's input or a frozen weight gets none."""
    packet = stands_for(node).overloadpacket
    a, b = node.args[1:3] if packet in (aten.addmm, aten.baddbmm) else node.args[:2]
    shapes = matmul_shapes(*shape)
    return [shapes[which] for operand, which in ((a, "input_gradient"), (b, "weight_gradient"))
            if needs_gradient(operand)]


def _attention(inputs, out, args) -> tuple:
    q, k, v = inputs[0], inputs[1], inputs[2]
    scores = _numel(q[:-1]) * k[-2]  # batch x heads x s_q x s_k
    return 2 * scores * q[-1] + 2 * scores * v[-1], 0


# op -> rule giving (matmul FLOPs, other FLOPs) from input shapes, output shape and args.
MATMUL_RULES: dict[object, Callable] = {
    aten.linear: _linear,
    aten.mm: _mm,
    aten.addmm: _mm,
    aten.bmm: _mm,
    aten.baddbmm: _mm,
    aten.matmul: _matmul,
    aten.scaled_dot_product_attention: _attention,
    torch.ops.fxpar.attention_with_dropout_mask: _attention,  # sdpa with dropout (passes.random_draws)
}
_ATTENTION = {aten.scaled_dot_product_attention, torch.ops.fxpar.attention_with_dropout_mask}
# Random draws (fxpar.ops.random_ops): FLOPs per element drawn (the draw and the test against p).
# Under rng=exact a rank draws the whole value, `DrawSlice.whole_factor` times its piece: the
# stated price of drawing one device's values.
_DRAWS = {torch.ops.fxpar.random_like, torch.ops.fxpar.attention_dropout_mask}
_DRAW_FLOPS = 2

# op -> FLOPs per output element (per input element for reductions and losses).
_PER_ELEMENT: dict[object, int] = {
    aten.add: 1, aten.sub: 1, aten.mul: 1, aten.div: 1, aten.neg: 1, aten.where: 1,
    aten.pow: 1, aten.rsqrt: 1, aten.sqrt: 1, aten.exp: 1, aten.reciprocal: 1,
    aten.maximum: 1, aten.minimum: 1, aten.clamp: 1, aten.masked_fill: 1,
    aten.relu: 1, aten.sigmoid: 4, aten.tanh: 4, aten.silu: 5, aten.gelu: 8,
    aten.cos: 1, aten.sin: 1,
    aten.dropout: 2,  # draw the mask, multiply by it and rescale
    aten.sum: 1, aten.mean: 1, aten.amax: 1, aten.var_mean: 3,
    aten.layer_norm: 5,  # mean, variance, normalise, scale, shift
    aten.rms_norm: 4,  # square, mean, normalise, scale
    aten.softmax: 5, aten._softmax: 5, aten.log_softmax: 5, aten._log_softmax: 5,
    aten.cross_entropy_loss: 6,  # log-softmax and the target pick, per logit
    torch.ops.fxpar.chunked_cross_entropy: 6,  # the same, a block of rows at a time
    torch.ops.fxpar.chunked_row_max: 1,  # a vocabulary-parallel loss's maximum per row
    torch.ops.fxpar.chunked_vocab_stats: 4,  # its shift, exponential, sum and target pick
    aten.nll_loss: 1, aten.mse_loss: 3,  # difference, square, mean
    aten.abs: 1, aten.log: 1, aten.erf: 1, aten.square: 1, aten.addcmul: 2,
    aten.linalg_vector_norm: 2,
}
_REDUCING = {
    aten.sum, aten.mean, aten.amax, aten.var_mean, aten.cross_entropy_loss, aten.nll_loss,
    torch.ops.fxpar.chunked_cross_entropy, torch.ops.fxpar.chunked_row_max, torch.ops.fxpar.chunked_vocab_stats,
    aten.mse_loss, aten.linalg_vector_norm,
}

# Free: views and metadata. Copies and creations cost their bytes, no FLOPs.
_FREE = {
    aten.view, aten._unsafe_view, aten.reshape, aten.transpose, aten.permute, aten.t,
    aten.expand, aten.unsqueeze, aten.squeeze, aten.slice, aten.select, aten.split,
    aten.split_with_sizes, aten.chunk, aten.unbind, aten.alias, aten.detach, aten.sym_size,
    aten.sym_numel, aten.sym_stride, aten.flatten, aten.unflatten, aten.view_as,
    aten._assert_scalar, aten._assert_tensor_metadata, aten.lift_fresh_copy,
    aten.broadcast_tensors, aten.expand_as,
}
_MEMORY_ONLY = {
    aten.embedding, aten.clone, aten.contiguous, aten.cat, aten.stack, aten.arange,
    aten.zeros, aten.ones, aten.full, aten.empty, aten.zeros_like, aten.ones_like,
    aten.full_like, aten.empty_like, aten.copy, aten._to_copy, aten.to, aten.index_select,
    aten.gather, aten.repeat_interleave, aten.repeat, aten.tril, aten.triu, aten.scalar_tensor,
    aten.type_as,
    aten.index,  # a gather; in transformers' mask functions, per-(batch, q, kv) lookups
    aten.pad,  # ForCausalLMLoss shifts labels by padding one -100
    torch.ops.fxpar.vocab_parallel_embedding,  # an embedding on a vocabulary shard
    torch.ops.fxpar.localize_indices,
    aten.constant_pad_nd,
    aten.new_ones,
    aten.new_zeros,
    aten.new_full,
    aten.new_empty,
}
# Bytes only on integer and boolean tensors, where they build attention masks, position ids
# and loss targets (transformers' `create_causal_mask`, `find_packed_sequence_indices`): no
# FLOPs, as integer work is not floating-point work. On floating data they do arithmetic and
# have no rule yet, so they are listed as uncosted.
_INTEGER_MASKS = {
    aten.eq,  # q_idx and kv_idx in the same packed sequence
    aten.ne,  # where position ids jump: a packed sequence starts
    aten.lt,
    aten.le,  # causal: kv_idx <= q_idx
    aten.gt,  # sliding window: kv_idx > q_idx - window
    aten.ge,  # BERT's padding mask
    aten.__and__,  # combine the causal, window, padding and packing masks
    aten.__or__,
    aten.bitwise_and,
    aten.bitwise_or,
    aten.bitwise_not,
    aten.logical_and,
    aten.logical_or,
    aten.logical_not,
    aten.diff,  # position ids: differences between neighbours
    aten.cumsum,  # packed-sequence index of each token
}


# The classes of memory-bound ops a hardware profile may give bandwidths of their own
# (`Hardware.bandwidths`): on an H200 an add moves 5789 GB/s, a GELU 2930, a layer norm's
# forward 878, the fp32 cross-entropy over the logits about 1210 (its bytes as counted here), a
# copy 3910 (`benchmarks/fit_h200_profile.py`); on one EPYC core a residual add 65-72 GB/s, the
# exact GELU forward and backward 11-13 (erf: compute-bound), a layer norm 18-21 (`cost.calibrate`).
BYTE_KINDS = ("pointwise", "activation", "norm", "loss", "copy")
_ACTIVATIONS = {aten.gelu, aten.silu, aten.sigmoid, aten.tanh, aten.erf, aten.mish}
_NORMS = {aten.layer_norm, aten.rms_norm, aten.var_mean}
_LOSSES = {
    aten.cross_entropy_loss, aten.log_softmax, aten._log_softmax, aten.softmax, aten._softmax, aten.nll_loss,
    torch.ops.fxpar.chunked_cross_entropy, torch.ops.fxpar.chunked_row_max, torch.ops.fxpar.chunked_vocab_stats,
}


def byte_kind(packet) -> str:
    """The class of `BYTE_KINDS` an op's bytes belong to."""
    if packet in _NORMS:
        return "norm"
    if packet in _LOSSES:
        return "loss"
    if packet in _ACTIVATIONS:
        return "activation"
    return "copy" if packet in _MEMORY_ONLY else "pointwise"


def _nbytes(node: fx.Node, shape: Shape) -> sympy.Expr:
    value = node.meta.get("val")
    return _numel(shape) * value.dtype.itemsize if isinstance(value, torch.Tensor) else 0


def cost_of(node: fx.Node, shape_of: Callable[[fx.Node], Shape]) -> OpCost | None:
    """The forward cost of a call_function node, or None for nodes that are not ops."""
    target = stands_for(node)
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if distributed_op(node) is not None:
        return None  # communication: priced per collective (cost.collectives), not as compute
    packet = target.overloadpacket
    if packet in _FREE:
        return OpCost(sympy.Integer(0), sympy.Integer(0), sympy.Integer(0))
    inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    in_shapes = [shape_of(a) for a in inputs]
    value = node.meta.get("val")
    out_shape = shape_of(node) if isinstance(value, torch.Tensor) else ()
    moved = sum((_nbytes(a, s) for a, s in zip(inputs, in_shapes)), sympy.Integer(0))
    moved += _nbytes(node, out_shape) if isinstance(value, torch.Tensor) else 0
    if is_grouped_mm(node):  # each row times its expert's (k, n) weight
        (rows, k), n = in_shapes[0], out_shape[-1]
        return OpCost(2 * rows * k * n, sympy.Integer(0), moved, shape=(rows, k, n))
    if packet in MATMUL_RULES:
        matmul, other = MATMUL_RULES[packet](in_shapes, out_shape, node.args)
        matmul = sympy.sympify(matmul)
        if packet in _ATTENTION:
            return OpCost(matmul, sympy.sympify(other), moved, attention_flops=matmul)
        return OpCost(matmul, sympy.sympify(other), moved, shape=_dense_shape(packet, in_shapes, out_shape))
    if packet in _DRAWS:
        return OpCost(sympy.Integer(0), _DRAW_FLOPS * _numel(out_shape), moved)
    if packet in _PER_ELEMENT:
        counted = in_shapes[0] if packet in _REDUCING and in_shapes else out_shape
        return OpCost(sympy.Integer(0), _PER_ELEMENT[packet] * _numel(counted), moved, kind=byte_kind(packet))
    if packet in _MEMORY_ONLY:
        return OpCost(sympy.Integer(0), sympy.Integer(0), moved, kind="copy")
    if packet in _INTEGER_MASKS:
        tensors = [a.meta["val"] for a in inputs]
        tensors += [value] if isinstance(value, torch.Tensor) else []
        if not any(t.is_floating_point() for t in tensors):
            return OpCost(sympy.Integer(0), sympy.Integer(0), moved)
    return OpCost(sympy.Integer(0), sympy.Integer(0), moved, costed=False)


@dataclass(frozen=True)
class ExactDraw:
    """A draw of rng=exact: `numel` values of the whole step's (global batch) value, of which
    each rank keeps `1 / pieces` (`fxpar.ops.random_ops.DrawSlice.whole_factor`) per microbatch."""

    stage: int | None
    numel: sympy.Expr
    pieces: int
    microbatches: int

    @property
    def extra_flops(self) -> sympy.Expr:
        """What drawing the whole value for every piece adds to the whole step's FLOPs
        (counted as the captured graph's are: work repeated on tp peers of a replicated
        value counts once)."""
        return _DRAW_FLOPS * self.numel * (self.pieces - 1)

    def extra_per_rank(self) -> sympy.Expr:
        """Values one rank draws in a step beyond its own pieces': the whole value for each of
        its microbatches, instead of its 1/pieces share of the whole step."""
        return self.numel * self.microbatches - self.numel * self.microbatches / self.pieces


def exact_draws(gm: fx.GraphModule, shape_of: Callable[[fx.Node], Shape]) -> list[ExactDraw]:
    """The draws of `gm` (the compiled global graph) made under rng=exact."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _DRAWS and node.args[4]:
            where = fxpar.ops.random_ops.DrawSlice(*node.args[5:11])
            found.append(ExactDraw(node.meta.get(meta.STAGE),
                                   _numel(shape_of(node)), where.whole_factor, where.microbatches))
    return found


def op_counts(gm: fx.GraphModule) -> tuple[int, int]:
    """(forward ops, backward nodes) of one forward and backward of `gm`, eager autograd.

    Forward ops are the aten calls that return tensors (views included: each is a dispatch;
    shape queries and asserts are not). Backward nodes are the forward ops whose output
    needs a gradient (`needing_gradient`), plus one `AccumulateGrad` per trainable parameter.
    It undercounts: a composite op may record several nodes (`linear` on a 3-d input records
    a view, a transpose and an addmm), which the graph does not show; the op overhead is
    measured per op as counted here (`cost.calibrate.TinyBlock`), so it carries them. For the
    example GPT this counts 86 backward nodes of the 123 autograd records (tiny, RESULTS.md).
    """
    needs_grad = needing_gradient(gm)
    forward = backward = 0
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and isinstance(stands_for(node), torch._ops.OpOverload) \
                and isinstance(value, torch.Tensor):
            forward += 1
            backward += node in needs_grad
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    accumulated = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in trainable}
    return forward, backward + len(accumulated)  # one AccumulateGrad per parameter


def needing_gradient(gm: fx.GraphModule, received: frozenset[str] = frozenset()) -> set[fx.Node]:
    """The nodes of `gm` whose value autograd computes a gradient for: the trainable
    parameters, the placeholders named in `received` (a pipeline stage's activations from the
    stage before, whose gradient it sends back), and every floating-point value computed from
    one (tuples and their getitems too: the gradient flows through them). Propagated here, as
    autograd does, rather than read from capture's metadata, which nodes the passes insert
    lack."""
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    needs_grad: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if (node.op == "get_attr" and node.target in trainable) or (node.op == "placeholder" and node.target in received):
            needs_grad.add(node)
        if node.op != "call_function":
            continue
        value = node.meta.get("val")
        differentiable = not isinstance(value, torch.Tensor) or value.is_floating_point()
        if differentiable and any(a in needs_grad for a in node.all_input_nodes):
            needs_grad.add(node)
    return needs_grad


def op_name(node: fx.Node) -> str:
    """`aten.linear.default` for an OpOverload target."""
    return str(node.target)




def node_seconds(node: fx.Node, shape_of: Callable[[fx.Node], Shape], device, *, precision: str) -> sympy.Expr:
    """Forward + backward seconds of one node of the captured graph, priced as the estimate
    prices a whole graph (`cost.step_time.piece_seconds`): a dense matmul's forward and the
    gradients' matmuls of its operands that need one (capture's `meta.requires_grad`), each at
    its shape (`Hardware.matmul_seconds`), 3 x `Hardware.kernel_seconds` of the rest
    of its cost, plus `op_overhead` for its forward op and, when its output needs a gradient,
    its backward node (`op_counts`' criteria). A formula in the graph's symbols, over the
    whole batch; the pipeline cut sums it per stage."""
    cost = cost_of(node, shape_of)
    if cost is None:
        return sympy.Integer(0)
    streamed = {cost.kind: cost.bytes if cost.matmul_flops == 0 else 0}
    kernels = device.kernel_seconds(cost.attention_flops, streamed, precision)
    dense = sympy.Integer(0)
    if cost.shape is not None:  # its forward, and the gradient of each operand that needs one
        needed = [cost.shape, *dense_gradients(node, cost.shape, meta.requires_grad)]
        dense = sum(device.matmul_seconds(*shape, precision) for shape in needed)
    value = node.meta.get("val")
    ops = 0
    if isinstance(stands_for(node), torch._ops.OpOverload) and isinstance(value, torch.Tensor):
        ops = 1 + bool(node.meta.get(meta.REQUIRES_GRAD, False))
    return 3 * kernels + dense + ops * device.op_overhead
