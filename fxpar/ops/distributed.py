"""The collectives a pass inserts, as registered operators that name a mesh axis.

Each is a `torch.library` custom op in the `fxpar` namespace with a fake kernel (so a rank
module traces under FakeTensorMode, torch.export and torch.compile) and a registered
autograd formula: its backward is the dual collective (Shoeybi et al. 2019, Sec. 3;
Korthikanti et al. 2022, Sec. 4.2.2). Rank module code reads as aten plus these:

    copy_to_region = torch.ops.fxpar.copy_to_region.default(layer_norm, 'tp')

    op                 forward          backward          where
    all_reduce         all-reduce       identity          g: leaving a row-parallel linear
    all_reduce_max     all-reduce max   (none)            vocab-parallel loss: the max logit
    copy_to_region     identity         all-reduce        f: entering column-parallel math
    split_to_shard     local slice      all-gather        a replicated value meets a shard
    all_gather         all-gather       local slice       a shard must become whole
    gather_to_region   all-gather       reduce-scatter    sequence parallelism's f
    reduce_scatter     reduce-scatter   all-gather        sequence parallelism's g
    gather_parameters  all-gather       reduce-scatter    ZeRO-3: a layer's parameter shards
                                                          (`fxpar.ops.parameter_gathers`)
    regather_parameters identity        all-gather        ZeRO-3: the layer's again, for
                                                          backward (reshard_after_forward)
    all_to_all         all-to-all       all-to-all        ep: the router's counts exchanged
    all_to_all_rows    all-to-all       all-to-all        ep: rows to the ranks of their experts
                                                          and back, as the counts split them
                                                          (`fxpar.ops.token_dispatch`)

`DistributedOp` is the one description of each: the kernels are built from its two
primitives, and lowering (`compiler.lowering.graph_calls`) predicts a step's calls from the
same two, so what the check and the cost model count is what runs. The axis is resolved when the op runs
(`fxpar.ir.axes.bound`); the group size rides in the op for the fake kernels, as in torch's own
functional collectives.

torch's functional collectives are not used: their all_reduce also all-reduces the gradient,
which multiplies the gradient of a replicated loss by the group size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from fxpar.ir.collectives import Phase
from fxpar.ops.collective_primitives import COMMUNICATING  # noqa: F401  (lowering and pictures read it here)
from fxpar.ops.collective_primitives import Primitive, fake, run
from fxpar.ops.deferred_linear import stands_for


@dataclass(frozen=True)
class DistributedOp:
    """One registered op: its forward and backward primitives (None: no gradient flows)."""

    name: str
    forward: Primitive
    backward: Primitive | None
    reduce: Literal["sum", "max"] = "sum"
    takes_dim: bool = False  # (x, axis, size, dim) rather than (x, axis)
    many: bool = False  # a list of tensors moved as one flat payload, argument `shards_arg`
    shards_arg: int = 0
    routed: bool = False  # (x, sent, received, axis, size): rows per rank as the router sends them

    @property
    def standard(self) -> bool:
        """Whether its kernels are built here, from the two primitives on (x, axis[, size, dim]);
        ZeRO-3's and the routed all-to-all's register in their own modules."""
        return not (self.many or self.routed)

    @property
    def axis_arg(self) -> int:
        return self.shards_arg + 1 if self.many else 3 if self.routed else 1

    def sources(self, node: fx.Node) -> list[fx.Node]:
        """The values whose pieces the op's call moves: its input, or a `many` op's list."""
        return list(node.args[self.shards_arg]) if self.many else [node.args[0]]

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.fxpar, self.name).default

    def primitive(self, phase: Phase) -> Primitive | None:
        return self.forward if phase == "forward" else self.backward

    def payload_dtype(self, node: fx.Node, phase: Phase) -> torch.dtype:
        """The dtype the op's `phase` collective moves: its sources' dtype, except that a
        ZeRO-3 op with a `dtype` gathers in that dtype (bf16-mixed's compute dtype) while its
        gradients are reduce-scattered in the pieces' own (`fxpar.ops.parameter_gathers`)."""
        pieces = self.sources(node)[0].meta["val"].dtype
        if self.many and self.primitive(phase) == "all_gather":
            return node.kwargs.get("dtype") or pieces
        return pieces

    def tag(self, axis: str, phase: Phase) -> str:
        """What the runtime's log calls this op's collective, and what the prediction says."""
        return f"{axis} {self.name}" + (" (backward)" if phase == "backward" else "")


OPS = (
    DistributedOp("all_reduce", "all_reduce", "identity"),
    DistributedOp("all_reduce_max", "all_reduce", None, reduce="max"),
    DistributedOp("copy_to_region", "identity", "all_reduce"),
    DistributedOp("split_to_shard", "slice", "all_gather", takes_dim=True),
    DistributedOp("all_gather", "all_gather", "slice", takes_dim=True),
    DistributedOp("gather_to_region", "all_gather", "reduce_scatter", takes_dim=True),
    DistributedOp("reduce_scatter", "reduce_scatter", "all_gather", takes_dim=True),
    DistributedOp("gather_parameters", "all_gather", "reduce_scatter", many=True),
    DistributedOp("regather_parameters", "identity", "all_gather", many=True, shards_arg=1),
    DistributedOp("all_to_all", "all_to_all", "all_to_all", takes_dim=True),
    DistributedOp("all_to_all_rows", "all_to_all", "all_to_all", routed=True),
)
BY_NAME = {op.name: op for op in OPS}


def distributed_op(node: fx.Node) -> DistributedOp | None:
    """The DistributedOp a call_function node runs, else None."""
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "fxpar":
        return BY_NAME.get(target.overloadpacket.__name__)
    return None


def axis_of(node: fx.Node) -> str:
    """The mesh axis a distributed op's node names."""
    op = distributed_op(node)
    return node.args[op.axis_arg if op is not None else 1]


# -- kernels -------------------------------------------------------------------------------------


@torch.library.custom_op(
    "fxpar::backward_collective", mutates_args=(),
    schema="(Tensor grad, str axis, int size, int dim, str primitive, str tag) -> Tensor",
)
def _backward_collective(grad, axis, size, dim, primitive, tag):
    """The backward half of a DistributedOp, itself an op so that a traced backward keeps it."""
    return run(primitive, grad, axis, size, dim, "sum", tag, "backward")


@_backward_collective.register_fake
def _(grad, axis, size, dim, primitive, tag):
    return fake(primitive, grad, size, dim)


def _register(op: DistributedOp) -> None:
    schema = "(Tensor x, str axis, int size, int dim) -> Tensor" if op.takes_dim else "(Tensor x, str axis) -> Tensor"

    def kernel(x, axis, size=1, dim=0):
        return run(op.forward, x, axis, size, dim, op.reduce, op.tag(axis, "forward"), "forward")

    def fake_kernel(x, axis, size=1, dim=0):
        return fake(op.forward, x, size, dim)

    registered = torch.library.custom_op(f"fxpar::{op.name}", kernel, mutates_args=(), schema=schema)
    registered.register_fake(fake_kernel)
    if op.backward is None:
        return

    def setup_context(ctx, inputs, output):
        ctx.axis = inputs[1]
        ctx.size, ctx.dim = (inputs[2], inputs[3]) if op.takes_dim else (1, 0)

    def backward(ctx, grad):
        if op.backward != "identity":
            grad = torch.ops.fxpar.backward_collective(
                grad, ctx.axis, ctx.size, ctx.dim, op.backward, op.tag(ctx.axis, "backward")
            )
        return (grad, None, None, None) if op.takes_dim else (grad, None)

    registered.register_autograd(backward, setup_context=setup_context)


for _op in OPS:
    if _op.standard:  # the ZeRO-3 ops register in fxpar.ops.parameter_gathers, the routed one in token_dispatch
        _register(_op)


# -- the eager lowering --------------------------------------------------------------------------


@dataclass(frozen=True)
class _EagerCall:
    """What one eager call of a DistributedOp fixes besides its tensor: made once per (op,
    in_place, axis, size, dim) by `_eager_function`, so a step's calls pass one argument to
    autograd (each argument of `Function.apply` costs a Python pass) and format no tags."""

    op: DistributedOp
    axis: str
    size: int
    dim: int
    in_place: bool  # the all-reduce (g's forward, f's backward) may overwrite its tensor
    forward_tag: str
    backward_tag: str


def _all_reduces_in_place(op: DistributedOp, in_place: bool, x: torch.Tensor) -> bool:
    """Whether the eager op's forward all-reduce runs on `x` itself: allowed at the node
    (`reduces_in_place`) and `x` contiguous."""
    return in_place and op.forward == "all_reduce" and x.is_contiguous()


class _Eager(torch.autograd.Function):
    """A DistributedOp as one autograd.Function: the same primitives as the registered op,
    without its trip through the dispatcher (see `lower_for_eager`). With `in_place`, the
    all-reduce of the op (g's forward, f's backward) reduces its tensor where it lies, as
    Megatron does, instead of into a copy: `lower_for_eager` says when that is safe."""

    @staticmethod
    def forward(ctx, x, call: _EagerCall):
        ctx.call = call
        op = call.op
        if op.forward == "identity":
            return x.view_as(x)  # an autograd.Function may return a view: no copy
        in_place = _all_reduces_in_place(op, call.in_place, x)
        if in_place:
            ctx.mark_dirty(x)
        return run(op.forward, x, call.axis, call.size, call.dim, op.reduce, call.forward_tag, "forward", in_place)

    @staticmethod
    def backward(ctx, grad):
        call = ctx.call
        primitive = call.op.backward
        if primitive is None:
            return None, None
        if primitive != "identity":
            in_place = call.in_place and primitive == "all_reduce"
            grad = run(primitive, grad.contiguous() if in_place else grad, call.axis, call.size, call.dim,
                       "sum", call.backward_tag, "backward", in_place)
        return grad, None


def _eager_function(op: DistributedOp, *, in_place: bool):
    calls: dict[tuple[str, int, int], _EagerCall] = {}  # by (axis, size, dim): a graph has few

    def run(x, axis, size=1, dim=0):
        call = calls.get((axis, size, dim))
        if call is None:
            call = calls[axis, size, dim] = _EagerCall(
                op, axis, size, dim, in_place, op.tag(axis, "forward"), op.tag(axis, "backward"))
        return _Eager.apply(x, call)

    run.__name__ = run.__qualname__ = op.name + ("_in_place" if in_place else "")
    run.__module__ = __name__ + ".eager"
    return run


EAGER = {(op.overload, in_place): _eager_function(op, in_place=in_place)
         for op in OPS if op.standard for in_place in (False, True)}
# Ops whose output is a fresh tensor, and whose input gradient is one: a matmul of x.
_MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default,
            torch.ops.aten.bmm.default}


def reduces_in_place(node: fx.Node, op: DistributedOp) -> bool:
    """Whether the eager op at `node` may all-reduce without a copy: its forward all-reduce's
    input is a matmul's fresh output that nothing else reads (g after a row-parallel linear),
    or its backward all-reduce's gradient comes from matmuls that read the op's output as
    their input (f before column-parallel linears), which autograd hands over fresh."""
    if op.forward == "all_reduce":
        source = node.args[0]
        return isinstance(source, fx.Node) and len(source.users) == 1 and stands_for(source) in _MATMULS
    if op.backward == "all_reduce":
        return bool(node.users) and all(
            stands_for(user) in _MATMULS and user.args[0] is node and node not in user.args[1:]
            for user in node.users
        )
    return False


def shares_storage_at_run_time(node: fx.Node, x: torch.Tensor) -> bool:
    """Whether the eager op at `node` returns a tensor on its input `x`'s storage (`_Eager`):
    an identity forward (a view), or an all-reduce in place. The registered op always copies
    (a custom op may not alias); what autograd saves is counted by storage, so the cost
    model's fake forward shares it too (`cost.activations`)."""
    op = distributed_op(node)
    if op is None or not op.standard:
        return False
    return op.forward == "identity" or _all_reduces_in_place(op, reduces_in_place(node, op), x)


def lower_for_eager(gm: fx.GraphModule) -> fx.GraphModule:
    """Point every distributed op of `gm` at its eager form, in place; returns `gm`.

    The registered op is the IR: what compile writes, what fake tensors, torch.export and
    torch.compile see, what the prediction reads. In eager training each call through the
    dispatcher costs about 45 us of Python (custom-op wrapper, autograd and redispatch
    layers, measured here on 2 loaded cores, against 25 us for a bare autograd.Function),
    paid by every f and g of every layer and microbatch; a step of the small GPT under tp=2
    has dozens. The runtime therefore runs the same primitives through `_Eager`, built from
    the same `DistributedOp`, so what runs is still what the check and the cost model read.
    Where the graph shows it is safe (`reduces_in_place`), the all-reduce skips its copy.
    """
    for node in gm.graph.nodes:
        if (op := distributed_op(node)) is not None and op.standard:
            node.target = EAGER[(node.target, reduces_in_place(node, op))]
    gm.recompile()
    return gm
