"""bf16 mixed precision as a graph rewrite: what each value is computed in, visible in the code.

`precision=bf16-mixed` (Micikevicius et al. 2018, "Mixed Precision Training"; with bf16, whose
8-bit exponent needs no loss scaling) trains with 16-bit working weights and activations and
32-bit master weights. fxpar stores each trained parameter *itself* in bf16 (DeepSpeed's
layout, the ZeRO paper's Sec. 3.1 accounting: 2 bytes of weights, with the fp32 master,
4 bytes, kept by the optimizer: `runtime.state.master_weights`), so the parameter node *is* the bf16
copy of the weight and every op reading it computes in bf16:

    h_0_attn_q_weight = getattr(self.h, "0").attn.q.weight        # bf16 (fxpar.master_dtype f32)
    linear = torch.ops.aten.linear.default(layer_norm, h_0_attn_q_weight, h_0_attn_q_bias)
    ...
    _to_copy = torch.ops.aten._to_copy.default(view_8, dtype = torch.float32)   # the loss's input
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(_to_copy, view_9, None, 2)

The rules, in graph order:

* a trained floating parameter's value becomes bf16; `fxpar.master_dtype` on its node keeps
  the dtype it is trained in (its master; what `full_state_dict` returns);
* buffers and inputs keep their dtypes, as under torch.autocast: models keep some buffers in
  fp32 on purpose (a rotary embedding's `inv_freq`, which bf16 would round to wrong
  positions), and an fp32 value meeting bf16 activations is computed in fp32 (torch's type
  promotion) until the next matmul, which reads a bf16 copy (below);
* a loss op (cross entropy, nll, mse, ...) reads fp32 copies of its floating inputs: the
  log-softmax and the sum over tokens run in fp32, as autocast runs them, and the loss
  (divided by the fp32 count) is fp32 when it reaches the user;
* a matmul-like op (linear, mm, bmm, matmul, addmm, baddbmm, attention, conv) or a
  normalisation with bf16 weights (layer norm, group norm, rms norm) reads bf16 copies of
  any operand the model itself computed in fp32 (an RMSNorm that upcasts, an additive fp32
  mask promoting the scores): autocast's rule for matmuls; so does a model's own kernel (an
  op outside aten, as transformers' grouped_mm of mixture-of-experts) that reads bf16 and
  fp32 operands, which has no type promotion to fall back on;
* export's `_assert_tensor_metadata` before a `.to()` asserts the input's new dtype;
* every other op computes in what its inputs are (torch's type promotion), and its recorded
  value (`meta["val"]`, under export's fake mode) is recomputed, so the payloads lowering
  writes (tp's all-reduces, a pipeline's transfers) say bf16 where bf16 travels.

Gradients follow by autograd: a bf16 parameter's gradient is bf16 (2 bytes), reduced over dp
in the plan's `reduce_dtype` (`ir.buckets.Bucket.reduce_dtype`).

ZeRO-3 (parameters `FlatShard` on dp, gathered before use, `passes.zero3`, later): with
`reduce_dtype=bf16` the gather reads the bf16 parameter, so parameters travel and are stored
in bf16 (2/N bytes each) with the fp32 master the same piece in fp32 inside the optimizer;
with `reduce_dtype=fp32` (FSDP2's way) that pass makes each piece its fp32 master again and
gathers it cast to bf16, so what the layer computes in is the same. Nothing else in this
pass changes.

Runs right after the loss normalisation, before tensor parallelism, so every later pass
(and its inserted ops) sees the dtypes the rank really computes in.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.passes.contracts import broken, ensures

aten = torch.ops.aten
WORKING = torch.bfloat16
MASTER = torch.float32

_READ_BF16 = {
    aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
    aten.baddbmm.default, aten.scaled_dot_product_attention.default, aten.conv1d.default,
    aten.conv2d.default, aten.einsum.default,
    # Normalisations read bf16 weights, and torch's CPU kernels refuse an fp32 input with them.
    aten.layer_norm.default, aten.native_layer_norm.default, aten.group_norm.default,
    aten.rms_norm.default,
}
_LOSSES = {
    aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
    aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
    aten.binary_cross_entropy_with_logits.default, aten.binary_cross_entropy.default,
    aten.kl_div.default,
}
_COPIED_META = ("nn_module_stack", "stack_trace", meta.MODULE_PATH, meta.REQUIRES_GRAD)


def computes_in_bf16(gm: fx.GraphModule) -> None:
    """Ensures: trained fp32 parameters are bf16 with an fp32 master; matmuls and
    normalisations read no fp32 operand; the graph returns an fp32 loss."""
    for name, node in meta.parameter_nodes(gm.graph).items():
        if node.meta.get(meta.MASTER_DTYPE) is not None and node.meta["val"].dtype != WORKING:
            raise broken(f"parameter {name} is a bf16 working copy", node)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _READ_BF16:
            for arg in node.all_input_nodes:
                if _dtype(arg) == MASTER:
                    raise broken("a matmul or normalisation reads bf16 operands", node)
    loss = _returned_loss(gm.graph)
    if loss is not None and _dtype(loss) != MASTER:
        raise broken("the loss the graph returns is fp32", loss)


@ensures(computes_in_bf16)
def cast_to_bf16(gm: fx.GraphModule) -> fx.GraphModule:
    """bf16 working parameters and activations, an fp32 loss (module doc).

    Requires: `meta["val"]` (export's fake values) on every node; `fxpar.parameter` on the
    parameter nodes; the loss normalised (the graph returns it).
    Ensures: `computes_in_bf16`; every value's `meta["val"]` has the dtype it is computed in;
    `fxpar.master_dtype` on each parameter stored in bf16.
    """
    graph = gm.graph
    values = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    fake_mode = detect_fake_mode(values) or contextlib.nullcontext()
    parameters = meta.parameter_nodes(graph)
    trained = {node for name, node in parameters.items() if _trains_in_fp32(gm, name, node)}
    recast: set[fx.Node] = set()  # nodes whose dtype this pass changed
    with fake_mode:
        for node in list(graph.nodes):
            if node in trained:
                node.meta[meta.MASTER_DTYPE] = MASTER
                node.meta["val"] = node.meta["val"].to(WORKING)
                recast.add(node)
            elif node.target is aten._assert_tensor_metadata.default:
                _assert_new_dtype(node)
            elif node.op == "call_function":
                reads_bf16 = node.target in _READ_BF16 or _mixes_without_promotion(node)
                wanted = MASTER if node.target in _LOSSES else WORKING if reads_bf16 else None
                if wanted is not None:
                    for arg in node.all_input_nodes:
                        if _dtype(arg) not in (None, wanted) and _dtype(arg).is_floating_point:
                            _cast_before(graph, arg, node, wanted, recast)
                if any(arg in recast for arg in node.all_input_nodes):
                    _recompute(node, recast)
        loss = _returned_loss(graph)
        if loss is not None and _dtype(loss) not in (None, MASTER):
            _cast_before(graph, loss, graph.output_node(), MASTER, recast)
    gm.recompile()
    return gm


def _mixes_without_promotion(node: fx.Node) -> bool:
    """Whether `node` is a model's own kernel (an op outside aten, such as transformers'
    grouped_mm for mixture-of-experts) reading bf16 and fp32 floating operands: such kernels
    have no type promotion, and the model's `x.to(weight.dtype)` before them was captured as
    a cast to fp32."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("aten", "prims", "fxpar"):
        return False
    floating = {_dtype(arg) for arg in node.all_input_nodes if _dtype(arg) is not None and _dtype(arg).is_floating_point}
    return {WORKING, MASTER} <= floating


def _returned_loss(graph: fx.Graph) -> fx.Node | None:
    """The scalar loss the graph returns (its one output, after `normalise_loss`)."""
    (returned,) = graph.output_node().args
    return returned if isinstance(returned, fx.Node) else None


def _trains_in_fp32(gm: fx.GraphModule, name: str, node: fx.Node) -> bool:
    value = gm.get_parameter(name)
    return value.requires_grad and value.dtype == MASTER and _dtype(node) == MASTER


def _dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _cast_before(graph: fx.Graph, source: fx.Node, user: fx.Node, dtype: torch.dtype, recast: set[fx.Node]) -> None:
    """`user` alone reads `_to_copy(source, dtype)` instead of `source`."""
    with graph.inserting_before(user):
        cast = _cast_node(graph, source, dtype)
    user.replace_input_with(source, cast)
    recast.add(cast)


def _cast_node(graph: fx.Graph, source: fx.Node, dtype: torch.dtype) -> fx.Node:
    cast = graph.call_function(aten._to_copy.default, (source,), {"dtype": dtype})
    cast.meta.update({k: source.meta[k] for k in _COPIED_META if k in source.meta})
    cast.meta["val"] = source.meta["val"].to(dtype)
    return cast


def _assert_new_dtype(node: fx.Node) -> None:
    """Export's check before a `.to()` (`_assert_tensor_metadata`) asserts the dtype its input
    has now."""
    dtype = _dtype(node.args[0])
    if len(node.args) > 3:
        node.args = (*node.args[:3], dtype, *node.args[4:])
    elif node.kwargs.get("dtype") is not None:
        node.kwargs = {**node.kwargs, "dtype": dtype}


def _recompute(node: fx.Node, recast: set[fx.Node]) -> None:
    """`node`'s value at its inputs' new dtypes (export's fake mode is active)."""
    old = node.meta.get("val")
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    try:
        new = node.target(*args, **kwargs)
    except Exception as error:
        dtypes = [str(_dtype(a)).removeprefix("torch.") for a in node.all_input_nodes if _dtype(a) is not None]
        raise PlanError(
            f"plan precision=bf16-mixed: {meta.describe(node)} does not run on inputs of dtypes "
            f"{', '.join(dtypes)} ({type(error).__name__}: {str(error)[:200]}). Fix: compute it in one "
            "dtype in the model (e.g. cast its inputs alike), or precision=fp32",
            field="precision",
            value="bf16-mixed",
        ) from error
    node.meta["val"] = new
    if _dtypes(new) != _dtypes(old):
        recast.add(node)


def _dtypes(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value.dtype,)
    if isinstance(value, (tuple, list)):
        return tuple(d for v in value for d in _dtypes(v))
    return ()
