"""Backward's workspace: what a rank allocates beside the activations it saved.

When a rank's peak comes, in backward, every activation it saved for the microbatches in
flight is alive (`cost.activations`) and backward allocates more on top. Where that comes
from depends on what the rank runs:

* the loss (`loss_workspace_bytes`): when backward starts every saved tensor is still alive
  and the loss's backward allocates W = 2 x the largest tensor the loss is computed from:
  for cross-entropy over logits, the logits' gradient and the log-softmax gradient. Fitted on
  the example GPT on the CPU, where the measured peak of all nine configurations is at the
  start of backward and this W accounts for it (RESULTS.md, "memory peak"). It is not
  2 x the largest tensor of the graph: a GPT's MLP hidden (4h wide) is often larger than its
  logits, but its gradient exists only once later layers have freed their saved tensors;
* one op's backward (`backward_bytes`): a pipeline stage without the loss starts its
  backward at its last op, with the activations of every microbatch in flight saved, so no
  loss's gradient frees room first: the incoming gradient of one op's output and the
  gradients of its differentiable inputs, weights included, exist together on top of them.
  Not on the loss's rank: there the large ops' backwards run once later layers have freed
  their saved tensors (the measured peaks of RESULTS.md, "memory peak", are W's). A
  pipeline's last stage with small microbatches comes out above it: `dp=2 pp=2 mb=8` measured
  6.71 MiB against 6.48 predicted, 3.5% (open); The largest over
  the rank's ops, from the fake forward of its modules (`cost.activations`), with their
  tensor-parallel pieces (for a GPT block, an MLP linear: the hidden's gradient, the input's
  and the weight's). An op whose value is a view of its input allocates nothing;
* under a zero-bubble schedule, the deferred weight gradients (`backward_bytes`): from a
  microbatch's B to its W the store keeps each deferred linear's input and output gradient
  (`runtime.step.weight_gradients`), for as many microbatches as the rank's row has between
  the two (`waiting_for_w`). A bound: on the loss's stage the head's output gradient is the
  logits' gradient, counted in the loss's W too (measured, `dp=2 pp=2 mb=4 schedule=zb-h1`:
  12.50 and 12.93 MiB against 13.63 and 13.81 predicted);
* ZeRO-3's gathered layers (`gathered_bytes`): a layer's backward reads its whole weights,
  gathered again (`runtime.state.parameter_gatherer`): the gather's flat buffer and the
  values copied out of it exist together for a moment, and the next `prefetch` layers'
  gathers are in flight beside them (each its flat buffer and this rank's laid-out pieces).
  So 2 W + prefetch x (W + W / dp), W the rank's largest layer gathered whole. Beside them,
  the reduce-scatter of the layer above still in flight: its gradients laid out whole (G,
  when reduced per microbatch) and, on gloo, the all-to-all's receive buffer (G again). On
  the loss's rank the layers' backwards come after the loss's has freed its W, so the
  larger of the two; on a stage without the loss, beside one op's backward. A bound: the
  layer above has freed its saved activations by then. Measured (small GPT, 4 CPU ranks,
  each allocation of the step followed by its address): at `dp=4 zero=3` 2.46 MiB live at
  the peak beside the activations, in the top layer's backward: its re-gathered values
  (0.756), the next layer's flat buffer in flight (0.756), gloo's staging copy of it
  (0.756) and its laid-out pieces (0.189); at `dp=4 zero=3 mb=2` the peak is a layer lower,
  with the reduce-scatter's receive buffer (0.756) beside them;
* the pipeline's transfers (`transfer_bytes`): the executor waits for its sends at the end
  of the step, so that a rank never blocks on a peer that waits on it
  (`runtime.step.pipeline_executor`); every microbatch's sent activations and input
  gradients are held until then. And receives are posted ahead (on gloo one action ahead),
  so the running action's and the next one's buffers exist together. Read from the rank's
  step program, the list of what the runtime sends and receives.

Measured on 4 CPU ranks (small GPT, `dp=2 pp=2 mb=8`, stage 0, state before a step plus the
step's allocation peak): 9.373 MiB, of which 0.688 MiB beyond the saved activations: 0.375
MiB an MLP linear's backward, the rest the eight microbatches' sent activations and the
receive buffers. This module's terms give 0.699 MiB.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from fxpar.cost.activations import most_open, observe_fake_forward
from fxpar.cost.input_pieces import boundary_pieces
from fxpar.cost.memo import memoised, module_key
from fxpar.frontend.trace import CapturedGraph
from fxpar.ir.collectives import backend_for
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.step_program import Exchange
from fxpar.ir.symbols import BATCH
from fxpar.ops import deferred_linear


def loss_workspace_bytes(captured: CapturedGraph) -> sympy.Expr:
    """W: 2 x bytes of the largest tensor input of the op that computes the loss (module doc).

    A formula in the example's (global) batch and seq, like `saved_activation_bytes`.
    """
    gm = captured.graph_module
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0]
    if isinstance(loss, (tuple, list)):
        loss = loss[0]
    candidates = [sympy.Integer(0)]
    for node in loss.all_input_nodes if isinstance(loss, fx.Node) else ():
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            candidates.append(sympy.Mul(*captured.shape(node)) * value.dtype.itemsize)
    return 2 * sympy.Max(*candidates)


def backward_bytes(program: CompiledProgram, rank: int) -> tuple[sympy.Expr, sympy.Expr]:
    """On `rank`, the most bytes one op's backward holds at once (its output's gradient and its
    differentiable inputs') and, under a zero-bubble schedule, the bytes one microbatch's
    deferred weight gradients keep from its B to its W, summed over the rank's modules (module
    doc). Formulas in the example's global batch and seq, like
    `cost.activations.rank_activation_bytes`; each distinct module traced once per capture."""
    captured, given = program.captured, set(program.input_names)
    pieces = boundary_pieces(program)

    def trace(module: fx.GraphModule) -> tuple[sympy.Expr, sympy.Expr]:
        sizes: set[sympy.Expr] = {sympy.Integer(0)}
        # storage id -> (the tensor, its bytes): the stored inputs and output gradients. The tensor
        # is kept so that its storage lives and its id cannot be handed to another's (which
        # made the sum vary from run to run).
        deferred: dict[int, tuple[torch.Tensor, object]] = {}

        def observe(node: fx.Node, inputs: list, value) -> None:
            if not (isinstance(value, torch.Tensor) and value.requires_grad):
                return
            if node.target is deferred_linear.linear:
                for tensor in (inputs[0], value):
                    deferred[id(tensor.untyped_storage())] = tensor, _nbytes(tensor)
            differentiable = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
            if any(x.untyped_storage() is value.untyped_storage() for x in differentiable):
                return  # a view: its backward reshapes the gradient it is given
            sizes.add(captured.readable(sum(_nbytes(x) for x in (value, *differentiable))))

        observe_fake_forward(module, captured, given, pieces, observe)
        return sympy.Max(*sizes), captured.readable(sum(size for _, size in deferred.values()))

    def shared(module: fx.GraphModule) -> tuple[sympy.Expr, sympy.Expr]:
        key = module_key(module, program.plan.compile, sorted(pieces.items()), sorted(given), None)
        return memoised(captured.graph_module, f"backward_bytes.{key}", lambda: trace(module))

    traced = [shared(m) for m in program.stage_modules(rank)]
    largest = sympy.Max(*(op for op, _ in traced))
    if program.schedule is None or not program.schedule.splits_backward:
        return largest, sympy.Integer(0)
    pending = waiting_for_w(program.schedule)[program.mesh.coord(rank).pp]
    return largest, sum((store for _, store in traced), sympy.Integer(0)) * pending / len(traced)


def gathered_bytes(program: CompiledProgram, rank: int) -> sympy.Expr:
    """Under ZeRO-3 over dp > 1, the most bytes `rank`'s layer gathers and reduce-scatters
    hold at once beside the saved activations (module doc): 2 W + prefetch x (W + W / dp) for
    the gathers, W the largest layer it gathers whole in the dtype the gather moves, and the
    reduce-scatter in flight, G the largest layer's whole gradients in the dtype they are summed
    in; both read off the rank's step program (ZeRO-3's calls are its all-gathers and
    reduce-scatters on dp). Zero otherwise."""
    plan = program.plan
    if plan.zero != 3 or plan.dp == 1:
        return sympy.Integer(0)
    step = program.step_program(rank)
    calls = [c for action in (*step.actions, *step.optimizer) for c in action.calls if c.axis == "dp"]
    whole = max((_call_bytes(c) for c in calls if c.kind == "all_gather"), default=sympy.Integer(0))
    summed = max((_call_bytes(c) for c in calls if c.kind == "reduce_scatter"), default=sympy.Integer(0))
    # A reduce-scatter reduced per microbatch lays the layer's gradients out whole (once per
    # step, that buffer is the step's accumulated gradients, `cost.memory.peak_bytes`'s); on
    # gloo, fxpar's all-to-all receives the whole of it (`runtime.communicator`).
    in_flight = summed * (int(program.zero_reduce.per_microbatch) + int(_on_gloo(program)))
    return 2 * whole + plan.gathers_ahead * (whole + whole / plan.dp) + in_flight


def _on_gloo(program: CompiledProgram) -> bool:
    """Whether the ranks' collectives run on gloo by default: the backend a rank on the
    capture's device binds."""
    values = (n.meta.get("val") for n in program.captured.graph_module.graph.nodes if n.op == "placeholder")
    return backend_for(next(v.device for v in values if isinstance(v, torch.Tensor))) == "gloo"


def waiting_for_w(schedule) -> tuple[int, ...]:
    """Per pipeline rank, the most (stage, microbatch) whose B has run and W not yet."""
    return most_open(schedule, opened_by="B", closed_by="W")


def transfer_bytes(program: CompiledProgram, rank: int) -> sympy.Expr:
    """Bytes of pipeline transfers `rank` holds at its peak: every send of the step (waited for
    at its end) and two exchanges' receives (module doc); a formula in the global batch and
    seq. Zero without a pipeline."""
    if program.schedule is None:
        return sympy.Integer(0)
    exchanges = [a for a in program.step_program(rank).actions if isinstance(a, Exchange)]
    sent = sum((_call_bytes(c) for e in exchanges for c in e.sends), sympy.Integer(0))
    received = {sum((_call_bytes(c) for r in e.receives for c in r.calls), sympy.Integer(0)) for e in exchanges}
    ahead = 2 * sympy.Max(sympy.Integer(0), *received)  # the running action's and the next one's
    per_microbatch = {BATCH: BATCH / program.plan.microbatches}  # a call's batch is one microbatch's
    return program.captured.readable(sent + ahead).subs(per_microbatch)


def _call_bytes(call) -> sympy.Expr:
    return sympy.sympify(call.numel) * call.dtype.itemsize


def _nbytes(x: torch.Tensor):
    return x.numel() * x.element_size()
