"""`compile=inductor`: what the executors call for a module, compiled by torch.compile.

Under `compile=eager` each rank's module runs op by op: its graph's Python calls one kernel per
node, and the distributed ops run through their eager forms (`ops.distributed.lower_for_eager`).
Under `compile=inductor` the same forward, the GraphModule `StepContext.forwards` holds, goes to
`torch.compile(forward, backend="inductor", fullgraph=True)`, in its compiled form
(`ops.traced_collectives.compiled_form`: the distributed ops as code Dynamo traces through).
Dynamo traces the graph (a flat graph of aten ops, so nothing breaks it), AOTAutograd derives
its backward, and Inductor fuses both into kernels. Each collective, forward or backward, is a
start and a wait (`ops.collective_primitives.started`), the same primitive on the same bound
axis, so the step program, its guard and `comm_stats()` read the same calls; the post-grad pass
of `runtime.collective_schedule` places them: issued as soon as their input is computed, waited
for after the work that does not need them.

Two things around the graph change with it:

* The count of valid targets. Eager graphs wait for its all-reduce where they read it, through
  a Python call the runtime puts in the graph (`runtime.step.valid_targets.await_count`); a
  compiled graph cannot wait on a Python object, so the count settles just before the
  compiled forward runs (one synchronisation point a step earlier than in eager mode).
* Compilation happens at the module's first call (the first step, and again the first time a
  batch of another shape arrives, after which its sizes are dynamic). A graph Inductor cannot
  compile raises a PlanError there, before the forward has run a collective, naming the rank's
  module, the node and its module path where Dynamo's stack points at one, with
  `compile=eager` as the fix. Inductor's on-disk caches (the FX graph and AOTAutograd caches,
  on by default in torch) keep the compiled kernels, so a restart recompiles from the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo.exc
import torch._inductor.exc
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.passes.weight_gradients import takes_weight_gradients
from fxpar.runtime.compiled_segments import compiled_between_deferred_linears
from fxpar.runtime.step.valid_targets import CountArrival

# What a failed compilation raises: Dynamo's errors (a graph it cannot trace, or a backend
# failure it wraps) and Inductor's own, which recent torch raises unwrapped.
_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError)


class CompiledForward:
    """`forward` compiled by Inductor (module doc); called as the forward itself."""

    def __init__(self, forward: fx.GraphModule, *, arrival: CountArrival, name: str, gathers_ahead: int):
        self.forward = forward
        self.arrival = arrival
        self.name = name  # for messages: which of the rank's modules
        from fxpar.runtime.collective_schedule import compile_options  # loads Inductor: only here

        def inductor(module: fx.GraphModule) -> torch.nn.Module:
            return torch.compile(module, backend="inductor", fullgraph=True,
                                 options=compile_options(module, gathers_ahead))

        # A zero-bubble stage is compiled between its deferred linears (`compiled_segments`).
        self.compiled = (compiled_between_deferred_linears(forward, inductor)
                         if takes_weight_gradients(forward) else inductor(forward))

    def __call__(self, *inputs: torch.Tensor):
        self.arrival.settle()  # the compiled graph reads the count (module doc)
        try:
            return self.compiled(*inputs)
        except _COMPILE_ERRORS as error:
            raise PlanError(_message(self.compiled, self.name, error), field="compile", value="inductor") from error


def compiled_forwards(forwards: tuple[fx.GraphModule, ...], arrival: CountArrival, *,
                      gathers_ahead: int) -> tuple[Callable, ...]:
    """Each of a rank's forwards compiled (module doc); ZeRO-3 gathers `gathers_ahead` layers
    early (`runtime.collective_schedule`)."""
    return tuple(CompiledForward(f, arrival=arrival, name=f"module {i}", gathers_ahead=gathers_ahead)
                 for i, f in enumerate(forwards))


def _message(compiled: torch.nn.Module, name: str, error: Exception) -> str:
    node = _failing_node(compiled, error)
    where = ""
    if node is not None:
        path = _module_path(node)
        where = f" at node {node.name!r} ({node.target})" + (f" in module {path!r}" if path else "")
    lines = [line.strip() for line in str(error).strip().splitlines()] or [type(error).__name__]
    reason = " ".join([lines[0], *(line for line in lines[1:] if line.startswith("Explanation:"))])
    return (f"plan compile=inductor: Inductor could not compile this rank's {name}{where}: {reason}. "
            "Fix: compile=eager, which runs the same graph op by op")


def _failing_node(compiled: torch.nn.Module, error: Exception) -> fx.Node | None:
    """The node whose line of generated code Dynamo's stack last passes through, in the graph
    compiled or in one of its pieces (`torch.fx` maps a line, counted from the code's prologue,
    to the node's index; each GraphModule's code has a file name of its own)."""
    graphs = {type(m).forward.__code__.co_filename: m for m in compiled.modules() if isinstance(m, fx.GraphModule)}
    for frame in reversed(list(getattr(error, "real_stack", None) or ())):
        if (forward := graphs.get(frame.filename)) is None:
            continue
        lines, start = getattr(forward, "_lineno_map", None) or {}, getattr(forward, "_prologue_start", 0)
        nodes = list(forward.graph.nodes)
        if (index := lines.get(frame.lineno - start)) is not None and 0 <= index < len(nodes):
            return nodes[index]
    return None


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _ = list(stack.values())[-1]
    return path or None
