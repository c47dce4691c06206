"""Where a compiled graph issues its collectives and waits for them: issue early, wait late.

A pass over each graph Inductor compiles for a rank (its post-grad graph, forward or backward),
on the collectives that are two ops apart, `fxpar::collective_start` and the
`_c10d_functional.wait_tensor` of its buffer (`ops.collective_primitives.started`: the
backward collectives of tensor parallelism's f, g and sequence-parallel ops).

    contract: for each start, in graph order, the nodes since the previous collective's wait
              that the start does not depend on move after it, and its wait after them. So a
              call goes out as soon as its input is computed and the work that does not need it
              runs while it is in flight: the input gradient of f's column-parallel linears is
              all-reduced while their weight gradients are computed (Megatron-LM's overlap of
              the tensor-parallel all-reduce with the weight-gradient GEMM, Narayanan et al.
              2021, Sec. 4.1's asynchronous communication). Collectives keep their order, the
              step program's (which the step guard holds call by call, and which every rank
              must share), and one is in flight at a time, so nothing waits behind a later call.
              Every node keeps its inputs before it: the result is a topological order.

Inductor would undo the order with its own memory-driven reordering (`reorder_for_peak_memory`,
which sees the wait as an op that frees nothing and pulls it up to its start), so the compile
that runs this pass turns that reordering off (`OPTIONS`): the order below is the one it emits.
A module without collectives (data parallelism's: its buckets are the runtime's) compiles with
Inductor's defaults, as `torch.compile` of the model would (`compile_options`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import fxpar.ops.collective_primitives  # noqa: F401  (registers fxpar::collective_start)

START = torch.ops.fxpar.collective_start.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def schedule_collectives(graph: fx.Graph) -> None:
    """Reorder `graph` in place as the module doc's contract says."""
    previous_wait: fx.Node | None = None
    for start in [n for n in graph.nodes if n.target is START]:
        waits = [user for user in start.users if user.target is WAIT]
        if len(waits) != 1:
            continue  # not the start-then-wait pair `started` writes: leave it where it is
        window = _since(graph, previous_wait, start)
        needed = _ancestors(start, set(window))
        independent = [n for n in window if n not in needed]
        cursor = start
        for node in independent:  # after the start, in their own order
            cursor.append(node)
            cursor = node
        cursor.append(waits[0])
        previous_wait = waits[0]
    graph.lint()


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
    """`schedule_collectives` as Inductor's post-grad pass; its uuid (this file's hash) keys
    Inductor's caches, so a changed pass is never read back from a cache of the old one."""

    def __call__(self, graph: fx.Graph) -> None:
        schedule_collectives(graph)

    def uuid(self) -> str:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


OPTIONS = {"post_grad_custom_post_pass": _SchedulePass(), "reorder_for_peak_memory": False}


def compile_options(module: torch.nn.Module) -> dict:
    """Inductor's options for compiling `module`: `OPTIONS` where one of its graphs (its own, or
    a checkpoint region's) runs a traced collective, Inductor's defaults where none does."""
    from fxpar.ops.traced_collectives import TRACED

    traced = set(TRACED.values())
    graphs = (m.graph for m in module.modules() if isinstance(m, fx.GraphModule))
    communicates = any(node.target in traced for graph in graphs for node in graph.nodes)
    return OPTIONS if communicates else {}
