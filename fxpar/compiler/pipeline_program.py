"""A compiled pipeline: the stages of the global graph, their boundaries and the schedule.

`build_stages` cuts the (tensor-parallel) global graph into `pp x virtual_stages` stage
graphs (`passes.pipeline`), sizes each stage's gradient buckets, and records which parameters
several stages read (a tied embedding and head), whose copies must stay identical.
The order a rank posts its transfers in (`issue_order`) is what lowering writes into its step
program (`fxpar.compiler.lowering`); `check_pipeline` proves that every send has its receive and that
the schedule cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import sympy
import torch.fx as fx

from fxpar.cost.activations import captured_saved_bytes_by_node
from fxpar.cost.memory import model_state_bytes
from fxpar.cost.ops import node_seconds
from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.stages import Stage
from fxpar.passes.infra import GraphPass, run_passes
from fxpar.passes.pipeline import split_stages
from fxpar.schedule.schedules import Schedule
from fxpar.schedule.simulation import DeadlockError, simulate


def build_stages(graph_module: fx.GraphModule, *, stage_passes: Sequence[GraphPass]) -> tuple[Stage, ...]:
    """Cut the annotated graph into its stages (`passes.pipeline.split_stages`), mark the
    parameters several stages read (`fxpar.tied_across_stages`), and run `stage_passes` on
    each (its gradient buckets: each stage reduces its own parameters)."""
    stages = split_stages(graph_module)
    tied = shared_parameters(stages)
    for stage in stages:
        for name, node in meta.parameter_nodes(stage.graph_module.graph).items():
            if name in tied:
                node.meta[meta.TIED_ACROSS_STAGES] = True
    return tuple(replace(stage, graph_module=run_passes(stage.graph_module, stage_passes)) for stage in stages)


def shared_parameters(stages: tuple[Stage, ...]) -> dict[str, tuple[int, ...]]:
    """Parameters read by more than one stage -> those stages (tied embedding and head)."""
    owners: dict[str, list[int]] = {}
    for stage in stages:
        for name in stage.parameter_names():
            owners.setdefault(name, []).append(stage.index)
    return {n: tuple(s) for n, s in owners.items() if len(s) > 1}


def receives_ahead(backend: str) -> int:
    """How many actions ahead of the running one a rank posts its receives: 1 on gloo, 0 else.

    gloo: a receive posted before the peer's send turns the transfer into a one-way write. gloo
    moves a message only once both sides have posted it, and a send that finds no receive
    waits for the receiver's "ready" notice, which the sender's I/O thread must then answer
    while its main thread computes the next action. Posted one action early, the receive is
    waiting when the send starts, and the data arrives while this rank computes. Measured with
    2 ranks on a 2-vCPU machine (benchmarks/RESULTS.md, "Receives posted one action ahead"):
    for the medium GPT under GPipe the idle time beyond the simulated bubble fell from +8.0 to
    +0.5..+2.1 percentage points of the step. gloo matches messages by tag, so the posting
    order is free.

    NCCL (and other backends): a pair of ranks' transfers run in order on one stream, and a
    receive holds that stream until its data arrives. A receive posted ahead would sit in front
    of a send the peer is waiting for: in 1F1B with p = 2, rank 0 would queue "receive the
    gradient of microbatch 0" before "send the activations of microbatch 1", while rank 1
    queues "receive those activations" before "send that gradient", and both would wait
    forever. So elsewhere an action's receives go out when it comes, in one batch with the
    previous action's sends (`Communicator.exchange`), as torch's 1F1B and Megatron-LM do.
    """
    return 1 if backend == "gloo" else 0


def issue_order(actions: int, ahead: int) -> Iterator[tuple[str, int]]:
    """("receive", i) and ("run", i) events for a rank with `actions` actions, in issue order.

    Action i's receives are posted before action i - `ahead` runs (`receives_ahead`). Per peer,
    receives stay in action order, so the send/receive pairing (`check_pipeline`) is the
    schedule's whatever `ahead` is.
    """
    posted = 0
    for i in range(actions):
        while posted <= min(i + ahead, actions - 1):
            yield "receive", posted
            posted += 1
        yield "run", i


def check_pipeline(ranks, schedule: Schedule, collectives_of) -> None:
    """Every send has its receive, in the same order per rank pair; the schedule cannot
    deadlock. `ranks`: the world size, or the ranks whose transfers to compare (pairs within
    them)."""
    try:
        simulate(schedule, 1, 2)
    except DeadlockError as error:
        raise PlanError(f"the pipeline schedule deadlocks:\n{error}", field="schedule") from None
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank in range(ranks) if isinstance(ranks, int) else ranks:
        for call in collectives_of(rank):
            if call.kind in ("send", "recv"):
                (other,) = [r for r in call.group if r != rank] or [rank]
                key = (rank, other) if call.kind == "send" else (other, rank)
                (sends if call.kind == "send" else recvs).setdefault(key, []).append(call)
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        shape = lambda call: (call.numel, call.dtype, call.phase)  # noqa: E731
        if [shape(c) for c in sent] != [shape(c) for c in received]:
            a, b = pair
            i = next((i for i, (x, y) in enumerate(zip(sent, received)) if shape(x) != shape(y)),
                     min(len(sent), len(received)))
            first = lambda calls: str(calls[i]) if i < len(calls) else "nothing"  # noqa: E731
            raise PlanError(
                f"rank {a} sends {len(sent)} tensors to rank {b}, which receives {len(received)}: "
                f"transfer #{i} is {first(sent)} on rank {a}'s side and {first(received)} on "
                f"rank {b}'s; the job would hang. This is an fxpar bug for a plan it accepted "
                "(or an edited step program): please report it",
                field="pp",
            )


def describe_stages(stages: tuple[Stage, ...], schedule: Schedule, captured, cost) -> str:
    """A table of the cut: each stage's rank, modules, parameters, share of the time, inputs.

    The modules column is as wide as its longest span, so whole module paths show.
    """
    times = [
        sum(cost(n) for n in s.graph_module.graph.nodes if n.op == "call_function") for s in stages
    ]
    total = sum(times) or 1.0
    rows = []
    for stage, seconds in zip(stages, times):
        paths = [
            meta.module_path(n) for n in stage.graph_module.graph.nodes
            if n.meta.get(meta.STAGE) == stage.index and meta.module_path(n)
        ]
        span = f"{paths[0]} .. {paths[-1]}" if paths else "-"
        params = sum(
            n.meta["val"].numel() for n in meta.parameter_nodes(stage.graph_module.graph).values()
        )
        shapes = ", ".join(
            str(tuple(captured.readable(d) for d in b.shape)) for b in stage.inputs
        ) or "the step's inputs"
        rows.append((stage.index, schedule.rank_of(stage.index), span, params, seconds, shapes))
    width = max([len("modules"), *(len(row[2]) for row in rows)])
    header = f"{'stage':>5} {'rank':>4}  {'modules':<{width}} {'parameters':>12} {'time':>6}"
    lines = [f"{header}  receives"]
    for index, rank, span, params, seconds, shapes in rows:
        lines.append(
            f"{index:>5} {rank:>4}  {span:<{width}} {params:>12,} "
            f"{100 * seconds / total:>5.1f}%  {shapes}"
        )
    return "\n".join(lines)


def node_memory(captured, *, microbatch: int, plan) -> callable:
    """(model-state bytes, activation bytes) a compute node brings to its stage.

    State: what `cost.memory.model_state_bytes` says one parameter costs under the plan's
    precision and ZeRO stage with AdamW (the estimate's default optimizer; 16 bytes in fp32
    without ZeRO), charged to the parameter's first user. Activations: what autograd saves for
    backward of the node's op at one microbatch, from the estimate's own fake forward of the
    captured graph under the plan's checkpointing (`cost.activations`): global values, so a
    tensor-parallel split scales every stage alike and leaves the shares the cut compares. A
    node a pass inserted saves nothing there; the collectives and casts passes add are small.
    """
    per_parameter = float(sum(model_state_bytes(
        1, precision=plan.precision, optimizer="adamw", zero=plan.zero, dp=plan.dp,
        reduce_dtype=plan.reduce_dtype,
    ).values()))
    sizes = {s: (microbatch if s.name == "batch" else v) for s, v in captured.example_sizes.items()}
    saved = {name: float(sympy.sympify(b).subs(sizes))
             for name, b in captured_saved_bytes_by_node(captured, checkpoint=plan.checkpoint).items()}
    first_users: dict[int, dict[fx.Node, float]] = {}  # per graph: node -> its parameters' bytes

    def state_of(graph: fx.Graph) -> dict[fx.Node, float]:
        if id(graph) not in first_users:
            order = {n: i for i, n in enumerate(graph.nodes)}
            state: dict[fx.Node, float] = {}
            for node in meta.parameter_nodes(graph).values():
                users = [u for u in node.users if u.op == "call_function"]
                if users:
                    first = min(users, key=order.__getitem__)
                    state[first] = state.get(first, 0.0) + per_parameter * node.meta["val"].numel()
            first_users[id(graph)] = state
        return first_users[id(graph)]

    def memory(node: fx.Node) -> tuple[float, float]:
        return state_of(node.graph).get(node, 0.0), saved.get(node.name, 0.0)

    return memory


def schedule_in_flight(schedule: Schedule) -> tuple[float, ...]:
    """Microbatches of activations each stage holds at its peak under `schedule`."""
    peaks = simulate(schedule, 1, 2).peak_in_flight
    return tuple(peaks[schedule.rank_of(s)] / schedule.v for s in range(schedule.stages))


def node_time(captured, hardware, *, precision: str = "fp32") -> callable:
    """Forward + backward seconds of a node at the example's sizes, for balancing stages:
    the estimate's own pricing (`cost.ops.node_seconds`)."""
    sizes = dict(captured.example_sizes)

    def cost(node: fx.Node) -> float:
        seconds = node_seconds(node, captured.shape, hardware, precision=precision)
        return float(sympy.sympify(seconds).subs(sizes))

    return cost


