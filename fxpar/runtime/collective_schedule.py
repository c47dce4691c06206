"""Where a compiled graph issues its collectives and waits for them: issue early, wait late.

A pass over each graph Inductor compiles for a rank (its post-grad graph, forward or backward),
on the collectives that are two ops apart, `fxpar::collective_start` and the
`_c10d_functional.wait_tensor` of its buffer (`ops.traced_collectives`: tensor parallelism's
f, g and sequence-parallel ops, ZeRO-3's gathers and reduce-scatters).

    contract: 1. for each start, in graph order, the nodes since the previous collective's
              wait that the start does not depend on move after it, and its wait after them.
              So a call goes out as soon as its input is computed and the work that does not
              need it runs while it is in flight: the input gradient of f's column-parallel
              linears is all-reduced while their weight gradients are computed (Megatron-LM's
              overlap of the tensor-parallel all-reduce with the weight-gradient GEMM,
              Narayanan et al. 2021, Sec. 4.1), and one call is in flight at a time.
              2. with `gathers_ahead=1` (the plan's `prefetch`, FSDP2's default), each ZeRO-3
              gather but the first then moves up, with what it needs, to right after the
              previous gather's wait: a layer is gathered while the one before it computes,
              ahead of that layer's other calls, in the call order eager mode's prefetch
              issues (`compiler.lowering.prefetched`); with 0 a gather stays where its layer
              reads it.
              Calls keep the step program's order, which the step guard holds call by call and
              every rank shares; every node keeps its inputs before it (a topological order).

Inductor would undo the order with its own memory-driven reordering (`reorder_for_peak_memory`,
which sees the wait as an op that frees nothing and pulls it up to its start), so the compile
that runs this pass turns that reordering off (`compile_options`): the order it emits is this one.
A module without collectives (data parallelism's: its buckets are the runtime's) compiles with
Inductor's defaults, as `torch.compile` of the model would.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from fxpar.ops.collective_primitives import forward_tag  # (registers fxpar::collective_start)
from fxpar.ops.parameter_gathers import OP as GATHER_OP

START = torch.ops.fxpar.collective_start.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def schedule_collectives(graph: fx.Graph, gathers_ahead: int = 1) -> None:
    """Reorder `graph` in place as the module doc's contract says; ZeRO-3's gathers
    `gathers_ahead` (0 or 1) layers early, or where their layer reads them."""
    pairs = _started_and_waited(graph)
    previous_wait: fx.Node | None = None
    for start, wait in pairs:
        if _gathers_parameters(start) and not gathers_ahead:
            previous_wait = wait  # where the layer reads it (the plan's prefetch=0)
            continue
        window = _since(graph, previous_wait, start)
        needed = _ancestors(start, set(window))
        cursor = start
        for node in [n for n in window if n not in needed]:  # after the start, in their order
            cursor.append(node)
            cursor = node
        cursor.append(wait)
        previous_wait = wait
    if gathers_ahead:
        _gather_ahead(graph, [(s, w) for s, w in pairs if _gathers_parameters(s)])
    graph.lint()


def _started_and_waited(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """Each start with its one wait, in graph order (a start without exactly one, which
    `started` never writes, is left where it is)."""
    pairs = []
    for start in [n for n in graph.nodes if n.target is START]:
        waits = [user for user in start.users if user.target is WAIT]
        if len(waits) == 1:
            pairs.append((start, waits[0]))
    return pairs


def _gathers_parameters(start: fx.Node) -> bool:
    """A ZeRO-3 gather of a layer's parameters (`ops.traced_collectives.TracedGather`)."""
    return forward_tag(start.args[6]).endswith(GATHER_OP.name)


def _gather_ahead(graph: fx.Graph, gathers: list[tuple[fx.Node, fx.Node]]) -> None:
    """Each ZeRO-3 gather but the first started right after the one before it completed, with
    what it needs, ahead of the calls and work between (FSDP's prefetch of one layer: the call
    order `compiler.lowering.prefetched` writes for depth 1); its wait stays where the layer
    first reads it."""
    for (_, previous_wait), (start, _) in zip(gathers, gathers[1:]):
        window = _since(graph, previous_wait, start)
        needed = _ancestors(start, set(window))
        cursor = previous_wait
        for node in [*(n for n in window if n in needed), start]:
            cursor.append(node)
            cursor = node


def _since(graph: fx.Graph, after: fx.Node | None, until: fx.Node) -> list[fx.Node]:
    """The computing nodes strictly between `after` (None: the graph's start) and `until`."""
    nodes, inside = [], after is None
    for node in graph.nodes:
        if node is until:
            return nodes
        if inside and node.op not in ("placeholder", "output"):
            nodes.append(node)
        inside = inside or node is after
    raise ValueError(f"{until.name} is not in the graph")


def _ancestors(node: fx.Node, among: set[fx.Node]) -> set[fx.Node]:
    """The nodes of `among` that `node` depends on, directly or not."""
    found: set[fx.Node] = set()
    stack = [n for n in node.all_input_nodes if n in among]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(n for n in current.all_input_nodes if n in among)
    return found


class _SchedulePass(CustomGraphPass):
    """`schedule_collectives` as Inductor's post-grad pass; its uuid (this file's hash and the
    depth) keys Inductor's caches, so a changed pass is never read back from a cache of the
    old one."""

    def __init__(self, gathers_ahead: int):
        self.gathers_ahead = gathers_ahead

    def __call__(self, graph: fx.Graph) -> None:
        schedule_collectives(graph, self.gathers_ahead)

    def uuid(self) -> str:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest() + f"-{self.gathers_ahead}"


def compile_options(module: torch.nn.Module, gathers_ahead: int) -> dict:
    """Inductor's options for compiling `module`: the schedule, ZeRO-3's gathers
    `gathers_ahead` layers early, and Inductor's memory reordering off (module doc) where one
    of its graphs (its own, or a checkpoint region's) runs a traced collective; Inductor's
    defaults where none does."""
    from fxpar.ops.traced_collectives import TRACED

    traced = set(TRACED.values())
    graphs = (m.graph for m in module.modules() if isinstance(m, fx.GraphModule))
    if not any(node.target in traced for graph in graphs for node in graph.nodes):
        return {}
    return {"post_grad_custom_post_pass": _SchedulePass(gathers_ahead), "reorder_for_peak_memory": False}
