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
        deferred: dict[int, object] = {}  # storage -> bytes: the stored inputs and output gradients

        def observe(node: fx.Node, inputs: list, value) -> None:
            if not (isinstance(value, torch.Tensor) and value.requires_grad):
                return
            if node.target is deferred_linear.linear:
                for tensor in (inputs[0], value):
                    deferred[id(tensor.untyped_storage())] = _nbytes(tensor)
            differentiable = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
            if any(x.untyped_storage() is value.untyped_storage() for x in differentiable):
                return  # a view: its backward reshapes the gradient it is given
            sizes.add(captured.readable(sum(_nbytes(x) for x in (value, *differentiable))))

        observe_fake_forward(module, captured, given, pieces, observe)
        return sympy.Max(*sizes), captured.readable(sum(deferred.values()))

    def shared(module: fx.GraphModule) -> tuple[sympy.Expr, sympy.Expr]:
        key = module_key(module, program.plan.compile, sorted(pieces.items()), sorted(given), None)
        return memoised(captured.graph_module, f"backward_bytes.{key}", lambda: trace(module))

    traced = [shared(m) for m in program.stage_modules(rank)]
    largest = sympy.Max(*(op for op, _ in traced))
    if program.schedule is None or not program.schedule.splits_backward:
        return largest, sympy.Integer(0)
    pending = waiting_for_w(program.schedule)[program.mesh.coord(rank).pp]
    return largest, sum((store for _, store in traced), sympy.Integer(0)) * pending / len(traced)


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
