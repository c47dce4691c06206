"""Pipeline stages cut on the graph: balanced by cost, boundaries known at compile time.

`assign_stages(gm, stages=S, split=..., cost=...)` gives every compute node a stage
(`fxpar.stage`); `split_stages(gm)` turns the annotated graph into one GraphModule per stage.

Where to cut. A cut after node i is *clean* when few tensors cross it: between transformer
blocks only the residual stream does. Among the cleanest cuts, a dynamic program picks the S-1
that minimise the most expensive stage (forward + backward time of its ops, embedding, final
norm, head and loss included), so a heavy head or embedding moves its neighbours. `split`
(module names, each starting a new stage) overrides the choice.

What a stage graph looks like. Stage k takes the tensors crossing into it (`boundary_0`, ...)
and the user inputs it reads; it returns the tensors later stages need, or the loss on the
last stage. Parameters, buffers and shape arithmetic (`sym_size`, positions from `arange`) are
copied into every stage that uses them, so nothing but activations crosses and every boundary
shape is a formula in batch and seq: no shape exchange at run time. A parameter read by two
stages (a tied embedding and head) appears in both; the runtime keeps the copies identical.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.stages import Boundary, Stage
from fxpar.passes.contracts import broken, ensures

aten = torch.ops.aten


def _replicable(node: fx.Node) -> bool:
    """Cheap nodes every stage recomputes instead of receiving.

    Inputs, parameters and buffers; shape arithmetic (`sym_size` and SymInt math); and tensors
    made from those alone without a trainable parameter: positions from `arange`, rotary
    tables sliced to the sequence length, masks.
    """
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload | type(len)):
        return False
    sources = node.all_input_nodes
    if any(s.op == "placeholder" and isinstance(s.meta.get("val"), torch.Tensor) for s in sources):
        return not isinstance(node.meta.get("val"), torch.Tensor)  # sym_size(idx) yes, embedding no
    # The cheap test first: recursing into an activation would walk the graph back to its
    # inputs from every node (quadratic in depth: 3.5 s of a 96-layer compile).
    return all(not meta.requires_grad(s) and _replicable(s) for s in sources)


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and not _replicable(n)]


def every_compute_node_staged(gm: fx.GraphModule) -> None:
    """Ensures: every compute node has a stage, non-decreasing in graph order, and each of
    the `fxpar.stages` stages holds at least one."""
    last, seen = 0, set()
    for node in _compute_nodes(gm.graph):
        stage = node.meta.get(meta.STAGE)
        if stage is None or stage < last:
            raise broken("every compute node has a stage, never lower than the one before", node)
        last = stage
        seen.add(stage)
    if seen != set(range(gm.meta.get(meta.GRAPH_STAGES, 0))):
        raise broken(f"each of the {gm.meta.get(meta.GRAPH_STAGES)} stages holds ops; found {sorted(seen)}")


@ensures(every_compute_node_staged)
def assign_stages(
    gm: fx.GraphModule,
    *,
    stages: int,
    split: tuple[str, ...] = (),
    cost=None,
    memory=None,
    in_flight: tuple[float, ...] = (),
) -> fx.GraphModule:
    """Annotate each compute node with its stage (see module doc).

    Requires: `fxpar.module_path` on nodes; `cost(node) -> float`, a node's forward+backward
    time (any unit); optionally `memory(node) -> (state bytes, activation bytes)` and
    `in_flight[s]`, the microbatches stage s keeps activations for under the schedule (1F1B's
    first stage holds p of them, GPipe's every stage m). The cut then minimises the worst
    stage over both time and peak memory, each as a share of its total. Ensures: `fxpar.stage` on every compute node, non-decreasing in graph
    order, every stage non-empty; `gm.meta["fxpar.stages"] = stages`.
    """
    nodes = _compute_nodes(gm.graph)
    position = {n: i for i, n in enumerate(nodes)}
    crossing = _crossing_counts(nodes, position)
    if split:
        cuts = _cuts_from_split(nodes, split, stages)
    else:
        cleanest = min(crossing[:-1]) if len(crossing) > 1 else 0
        candidates = [i for i in range(len(nodes) - 1) if crossing[i] <= cleanest]
        if len(candidates) < stages - 1:
            raise PlanError(
                f"the graph has {len(candidates)} clean cut points (between blocks), too few for "
                f"{stages} pipeline stages. Fix: use at most {len(candidates) + 1} stages "
                "(pp x virtual stages), or name the cuts with split=[...]",
                field="pp",
                value=stages,
            )
        weights = [float(cost(n)) if cost else 1.0 for n in nodes]
        held = [memory(n) if memory else (0.0, 0.0) for n in nodes]
        cuts = _balanced_cuts(weights, candidates, stages, held, in_flight or (1.0,) * stages)
    stage = 0
    boundaries = set(cuts)
    for i, node in enumerate(nodes):
        node.meta[meta.STAGE] = stage
        if i in boundaries:
            stage += 1
    gm.meta[meta.GRAPH_STAGES] = stages
    return gm


def _crossing_counts(nodes: list[fx.Node], position: dict[fx.Node, int]) -> list[int]:
    """For each i, how many compute values made at or before i are used after i."""
    last_use = {}
    for node in nodes:
        for source in node.all_input_nodes:
            if source in position:
                last_use[source] = max(last_use.get(source, -1), position[node])
        if node.next.op == "output" or any(u.op == "output" for u in node.users):
            last_use[node] = len(nodes)
    counts, live = [], 0
    ends = {}
    for i, node in enumerate(nodes):
        if last_use.get(node, i) > i:
            live += 1
            ends.setdefault(last_use[node], []).append(node)
        live -= len(ends.pop(i, []))
        counts.append(live)
    return counts


def _balanced_cuts(
    weights: list[float],
    candidates: list[int],
    stages: int,
    held: list[tuple[float, float]],
    in_flight: tuple[float, ...],
) -> list[int]:
    """Cut positions (among candidates) minimising the heaviest stage: a small DP.

    A stage's load is the larger of its share of the total time and its share of the total
    peak memory (state plus activations times the microbatches it keeps in flight).
    """
    def prefix_sums(values):
        sums = [0.0]
        for v in values:
            sums.append(sums[-1] + v)
        return sums

    time_prefix = prefix_sums(weights)
    state_prefix = prefix_sums([h[0] for h in held])
    activation_prefix = prefix_sums([h[1] for h in held])
    total_time = time_prefix[-1] or 1.0
    total_memory = state_prefix[-1] + activation_prefix[-1] * max(in_flight) or 1.0

    def load(first: int, last: int, stage: int) -> float:  # nodes first..last inclusive
        seconds = (time_prefix[last + 1] - time_prefix[first]) / total_time
        state = state_prefix[last + 1] - state_prefix[first]
        activations = activation_prefix[last + 1] - activation_prefix[first]
        return max(seconds, (state + activations * in_flight[stage]) / total_memory)

    n = len(weights)
    points = [-1] + candidates
    # best[k][j]: the smallest max-stage weight covering nodes 0..points[j] with k cuts used.
    best = {(0, 0): 0.0}
    choice = {}
    for k in range(1, stages):
        for j in range(1, len(points)):
            options = [
                (max(best[(k - 1, i)], load(points[i] + 1, points[j], k - 1)), i)
                for i in range(j)
                if (k - 1, i) in best
            ]
            if options:
                best[(k, j)], choice[(k, j)] = min(options)
    final = [
        (max(best[(stages - 1, j)], load(points[j] + 1, n - 1, stages - 1)), j)
        for j in range(1, len(points))
        if (stages - 1, j) in best
    ]
    _, j = min(final)
    cuts = []
    for k in range(stages - 1, 0, -1):
        cuts.append(points[j])
        j = choice[(k, j)]
    return sorted(cuts)


def _cuts_from_split(nodes: list[fx.Node], split: tuple[str, ...], stages: int) -> list[int]:
    if len(split) != stages - 1:
        raise PlanError(
            f"split names {len(split)} module(s), so {len(split) + 1} stages, but the plan asks "
            f"for {stages} (pp x virtual stages). Fix: name {stages - 1} modules where new "
            "stages begin",
            field="split",
            value=list(split),
        )
    cuts = []
    for name in split:
        starts = [
            i for i, n in enumerate(nodes)
            if meta.module_path(n) == name or meta.module_path(n).startswith(name + ".")
        ]
        if not starts:
            paths = sorted({meta.module_path(n) for n in nodes if meta.module_path(n)})
            raise PlanError(
                f"split names module {name!r}, which no op of the model belongs to. Modules "
                f"look like: {', '.join(paths[:6])}. Fix: name a module path",
                field="split",
                value=name,
            )
        if starts[0] == 0 or (cuts and starts[0] - 1 <= cuts[-1]):
            raise PlanError(
                f"split module {name!r} does not start a new stage after the previous one. "
                "Fix: list the modules in model order, none at the very start",
                field="split",
                value=name,
            )
        cuts.append(starts[0] - 1)
    return cuts


def split_stages(gm: fx.GraphModule) -> tuple[Stage, ...]:
    """One Stage per stage: its GraphModule, incoming and outgoing boundaries, user inputs.

    Requires: `fxpar.stage` on compute nodes (assign_stages). Each stage's forward takes
    `(*boundaries, *user_inputs)` and returns a tuple of outgoing boundaries (the loss alone
    on the last stage); a stage's outputs are the next stage's inputs.
    """
    stages = gm.meta[meta.GRAPH_STAGES]
    nodes = _compute_nodes(gm.graph)
    stage_of = {n: n.meta[meta.STAGE] for n in nodes}
    output = gm.graph.output_node()
    needed_after = _needed_after(nodes, stage_of, output, stages)
    result = [
        _stage_graph(gm, s, nodes, stage_of, incoming=needed_after[s - 1] if s > 0 else [],
                     outgoing=needed_after[s] if s < stages - 1 else None)
        for s in range(stages)
    ]
    return tuple(
        Stage(s, stage_gm, incoming, result[s + 1][1] if s + 1 < stages else (), user_inputs)
        for s, (stage_gm, incoming, user_inputs) in enumerate(result)
    )


def _needed_after(
    nodes: list[fx.Node], stage_of: dict[fx.Node, int], output: fx.Node, stages: int
) -> list[list[fx.Node]]:
    """Per stage s, the values made at or before s and used after it: what crosses from s to
    s + 1. The output counts as a use on the last stage, a node no stage owns as a use after
    every stage."""
    needed_after: list[list[fx.Node]] = [[] for _ in range(stages)]
    for node in nodes:
        last = max(
            [stage_of.get(u, stages) if u is not output else stages - 1 for u in node.users], default=0
        )
        for s in range(stage_of[node], min(last, stages - 1)):
            needed_after[s].append(node)  # made at or before s, used after s
    return needed_after


def _stage_graph(
    gm: fx.GraphModule,
    s: int,
    nodes: list[fx.Node],
    stage_of: dict[fx.Node, int],
    *,
    incoming: list[fx.Node],
    outgoing: list[fx.Node] | None,
) -> tuple[fx.GraphModule, tuple[Boundary, ...], tuple[str, ...]]:
    """Stage `s`'s GraphModule, its incoming boundaries and the user inputs it reads: it takes
    `incoming` (as `boundary_0`, ...) and those inputs, computes its nodes, copying what they
    read that no stage owns (module doc), and returns `outgoing`, or the loss on the last
    stage (`outgoing` None)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    boundaries = []
    for i, node in enumerate(incoming):
        env[node] = graph.placeholder(f"boundary_{i}")
        env[node].meta.update(node.meta)
        boundaries.append(_boundary(f"boundary_{i}", node))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    used_inputs = [p for p in placeholders if _reaches_stage(p, s, stage_of)]
    for p in used_inputs:
        env[p] = graph.placeholder(p.name)
        env[p].meta.update(p.meta)

    def copy(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        for source in node.all_input_nodes:
            copy(source)
        env[node] = graph.node_copy(node, lambda n: env[n])
        return env[node]

    for node in nodes:
        if stage_of[node] == s:
            copy(node)
    if outgoing is None:
        graph.output(copy(gm.graph.output_node().args[0]))
    else:
        graph.output(tuple(copy(n) for n in outgoing))
    attributes = {
        n.target: _attribute(gm, n.target) for n in graph.nodes if n.op == "get_attr"
    }
    stage_gm = fx.GraphModule(attributes, graph, class_name=f"Stage{s}")
    stage_gm.meta = {k: v for k, v in gm.meta.items()} | {meta.GRAPH_STAGE: s}
    return stage_gm, tuple(boundaries), tuple(p.name for p in used_inputs)


def _boundary(name: str, node: fx.Node) -> Boundary:
    """The boundary tensor `node`'s value crosses as: its shape (a formula in export's size
    symbols), dtype, whether a gradient flows back through it, and its placement."""
    value = node.meta["val"]
    shape = tuple(d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d) for d in value.shape)
    return Boundary(name, shape, value.dtype, meta.requires_grad(node), meta.placements(node))


def _reaches_stage(placeholder: fx.Node, stage: int, stage_of: dict[fx.Node, int]) -> bool:
    """Whether a user input feeds stage `stage` (directly or through replicated shape nodes)."""
    stack = list(placeholder.users)
    while stack:
        node = stack.pop()
        if node in stage_of:
            if stage_of[node] == stage:
                return True
        elif node.op == "call_function":
            stack.extend(node.users)
    return False


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


