"""`fxpar.verify`: run a plan and one device side by side and name the first node that differs.

    report = fxpar.verify(model, "tp=2", (tokens, labels))
    print(report)            # "... equals one device: ..." or the first divergent node
    assert report.equal

The reference is the captured graph on one device, its loss written as a sum over the step's
count of valid targets (the dp=1 compile: `passes.loss_normalisation`, an exact rewrite, so
its values are the model's). The parallel program runs one training step on CPU, in
`plan.world_size` processes forked from this one (gloo, a local store, every group with the
finite `timeout`): forked, not spawned, so they run exactly this compiled program, also one
a test or a tool has edited (`Program.replace_step_program`, a rank graph changed in place).
Every rank records each node's value and gradient (`verify_values.NodeRecorder`), the
reference does the same, and the pieces are made whole with the nodes' placements
(`verify_values.whole_value`). Then, in this order, the first value beyond the tolerance
(`verify_report`) is reported with its node, module path and both values' statistics:

    1. forward values, in the captured graph's order (inputs, parameters, every computed node);
    2. gradients of the values that depend on the batch, in the order backward makes them (the
       reverse), so the first wrong one is where backward went wrong, not where it ended up;
    3. each parameter's gradient after the step's reductions (`runner.full_gradients`), in the
       same order: what the optimizer would be given.

The nodes compared are the captured graph's (and the loss): a node that a pass removed (a
dropout rewritten to draw from its own stream) or the parallel graph does not compute under
its name is not compared (the report counts what was), nor is one made from sizes alone (`arange(batch)`:
each rank's is its own, not a slice of one device's). With `check` (the default) the program is proved
first (`Program.check`): a program whose ranks disagree would hang, not diverge.
`check=False` runs it anyway; a rank that fails ends the run with VerifyError naming each
rank's error. Random draws (dropout) come from one seed on both sides (`SEED`); with `rng=exact` in the
plan every rank draws exactly one device's values, so dropout is verified too; under
`rng=fast` the ranks draw their own pieces and verify refuses, as it refuses a lower precision
at the fp32 tolerance, before anything runs.
verify is for small configurations: it keeps every node's value. Forking needs a POSIX system.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp

from fxpar.compiler.program import Program, compile
from fxpar.errors import PlanError, VerifyError
from fxpar.ir import meta
from fxpar.ir.mesh import Mesh
from fxpar.ir.placement import Replicate, Shard
from fxpar.ops.random_streams import RandomStream, bind_random, unbind_random
from fxpar.tools.verify_report import ATOL, RTOL, Difference, Stats, VerifyReport, compare, node_code, tolerance_used
from fxpar.tools.verify_values import NodeRecorder, Pieces, whole_value


def verify(
    model: torch.nn.Module | Program,
    plan=None,
    example_inputs=None,
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    timeout: float = 30.0,
    check: bool = True,
) -> VerifyReport:
    """Compare one training step of `plan` with one device, node by node (module doc).

    `model` is a module (compiled here for `plan` on `example_inputs`, one global batch) or a
    compiled `Program` (then `plan` is not given). `timeout`: seconds any collective may wait.
    """
    if isinstance(model, Program):
        if plan is not None:
            raise TypeError("verify(program, example_inputs=...) takes no plan: the program has one")
        program = model
        if check:
            program.check()
    else:
        program = compile(model, plan, example_inputs, check=check)
    if example_inputs is None:
        raise TypeError("fxpar.verify needs example_inputs: the global batch both sides train on")
    if dist.is_initialized():
        raise VerifyError("fxpar.verify starts its own ranks, and this process is already in a process "
                          "group (a torchrun worker?). Fix: call it from one plain process")
    if program.plan.compile != "eager":
        raise VerifyError(f"fxpar.verify records every node's value as the rank's graph runs op by op, and "
                          f"plan '{program.plan}' compiles the graph, whose fused kernels keep no such values. "
                          "Fix: verify the plan with compile=eager (the same graph and collectives)")
    if any(p.is_meta for p in program.captured.parameters.values()):
        raise VerifyError("fxpar.verify runs the model, and its parameters are on the meta device. "
                          "Fix: build it on the CPU with real (random) weights")
    if program.plan.precision != "fp32" and rtol == RTOL:
        raise PlanError(
            f"plan precision={program.plan.precision} computes in lower precision than the one-device "
            f"fp32 reference, which verify's default rtol={RTOL:g} is for. Fix: pass an rtol for "
            "that precision (bf16 holds about 3 significant digits: rtol=2e-2)",
            field="precision", value=program.plan.precision)
    reference = compile(program.captured, "dp=1", check=False)
    _refuse_random_draws(program, reference)
    inputs = program.captured.arrange(*_as_call(example_inputs))
    names = _joined_names(program, reference)
    with tempfile.TemporaryDirectory(prefix="fxpar-verify-") as folder:
        ranks = _run_ranks(program, example_inputs, names, Path(folder), timeout)
        expected = _run_reference(reference, inputs, names, count_rides=program.step_program(0).count_slots() > 0)
    return _compare(program, reference, expected, ranks, names, rtol=rtol, atol=atol)


def _joined_names(program: Program, reference: Program) -> set[str]:
    """The nodes both sides are compared at: the captured graph's, whose names every compile
    keeps (`passes.infra.copy_graph_module`), and the loss. A node a pass adds gets a fresh
    name on each side, which may be another node's on the other (a tp pass adds more), so
    none of those is joined."""
    graph = reference.graph_module.graph
    kept = {n.name for n in program.captured.graph_module.graph.nodes if n.op != "output"}
    (loss,) = graph.output_node().all_input_nodes
    return {n.name for n in graph.nodes if n.name in kept or n.op == "placeholder"} | {loss.name}


SEED = 0  # the one seed both sides draw from (`fxpar.ops.random_streams`): the ranks' bind and the reference's
_FXPAR_DRAWS = ("fxpar.random_like", "fxpar.attention_dropout_mask")  # `passes.random_draws`' ops


def _refuse_random_draws(program: Program, reference: Program) -> None:
    """Raise VerifyError if the graph draws random numbers the ranks would not draw as one
    device does: unless the plan says `rng=exact`, each rank draws its own piece of a dropout
    mask (`fxpar.ops.random_streams`), and verify would report the first draw."""
    for node in reference.graph_module.graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        name, where = str(target.overloadpacket), meta.module_path(node) or "<root module>"
        if name in _FXPAR_DRAWS:
            if program.plan.rng == "exact":
                continue
            raise VerifyError(
                f"node {node.name} ({name}, module {where!r}) draws random numbers (p={node.args[2]}), and "
                f"plan rng={program.plan.rng} draws each rank's piece of them apart, not one device's "
                "values, so the first draw would be reported as a difference. Fix: verify with rng=exact "
                "in the plan (every rank then draws exactly one device's values), or dropout 0")
        if torch.Tag.nondeterministic_seeded in target.tags and not _no_dropout(name, node):
            raise VerifyError(
                f"node {node.name} ({name}, module {where!r}) draws from the process's own generator, "
                "which one device and the ranks advance differently. Fix: verify the model without it")


def _no_dropout(name: str, node) -> bool:
    """A dropout (or attention dropout) with p = 0, which export keeps and draws nothing."""
    index = {"aten.dropout": 1, "aten.native_dropout": 1, "aten.scaled_dot_product_attention": 4}.get(name)
    if index is None:
        return False
    p = node.args[index] if len(node.args) > index else node.kwargs.get("dropout_p", node.kwargs.get("p", 0.0))
    return not p


def _as_call(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return tuple(example_inputs), {}


# -- the two runs --------------------------------------------------------------------------------

def _run_reference(reference: Program, inputs: tuple[torch.Tensor, ...], names: set[str], *,
                   count_rides: bool) -> dict:
    """One device: every node's value and gradient, the parameters' gradients, the loss. The
    model's own parameters are read, never written (gradients by `autograd.grad`).

    Where the ranks' count of valid targets rides in a gradient bucket (`count_rides`), their
    graphs divide the loss's sum by 1 and the buckets divide the reduced gradients by the
    count (`runtime.step.loss`): the reference's graph is given 1 too, so node values and
    gradients compare as they are, and its loss and parameters' gradients are divided by the
    count after, as the buckets do."""
    gm = reference.rank_module(0)
    recorder = NodeRecorder.install(gm, names)
    sums = reference.loss_reduction.sums
    count = reference.loss_reduction.count_module(*inputs) if sums else None
    divisor = count if count_rides and sums else 1
    args = (*inputs, torch.ones_like(count) if count_rides else count) if sums else inputs
    stream = RandomStream(SEED)  # step 0, whole values: what rng=exact draws on the ranks
    bind_random(stream)
    try:
        loss = gm(*args)
        parameters = {n: gm.get_parameter(n) for n in meta.parameter_nodes(gm.graph)}
        trained = {n: p for n, p in parameters.items() if p.requires_grad}
        grads = torch.autograd.grad(loss, list(trained.values()), allow_unused=True)
    finally:
        unbind_random(stream)
    return {"loss": float(loss.detach() / divisor), "values": recorder.values, "grads": recorder.grads,
            "parameter_grads": {n: g / divisor for n, g in zip(trained, grads) if g is not None}}


def _run_ranks(program: Program, example_inputs, names: set[str], folder: Path, timeout: float) -> list[dict]:
    """Fork one process per rank, run one step in each, and load what each recorded."""
    world, port = program.world_size, _free_port()
    context = mp.start_processes(
        _rank_main, args=(world, port, program, example_inputs, names, folder, timeout),
        nprocs=world, join=False, start_method="fork",
    )
    limit = 60 + 4 * timeout  # starting the groups, one step, the gather, each bounded by timeout
    deadline = time.monotonic() + limit
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise VerifyError(f"the {world} ranks of plan '{program.plan}' did not finish within {limit:g} s")
    results = []
    for rank in range(world):
        path = folder / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else {"error": "it saved nothing"})
    failed = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    if failed:
        raise VerifyError(f"the parallel run of plan '{program.plan}' failed, so nothing was compared:\n  "
                          + "\n  ".join(failed))
    return results


def _rank_main(rank: int, world: int, port: int, program: Program, example_inputs, names: set[str],
               folder: Path, timeout: float) -> None:
    """One forked rank: bind, record, one step, the reduced gradients; saved to `folder`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share this machine's cores (and a forked OpenMP pool)
    try:
        runner = program.bind(timeout=timeout, seed=SEED)
        recorders = [NodeRecorder.install(m, names) for m in runner.executed_modules]
        args, kwargs = _as_call(example_inputs)
        if kwargs:
            loss = runner.step(runner.local_batch(kwargs))
        else:
            loss = runner.step(*runner.local_batch(*args))
        pieces: dict[str, tuple] = {}
        for module, recorder in zip(runner.modules, recorders):
            nodes = {n.name: n for n in module.graph.nodes}
            for name, values in recorder.values.items():
                pieces.setdefault(name, (meta.placements(nodes[name]), values, recorder.grads.get(name, {})))
        result = {"loss": loss, "pieces": pieces, "parameter_grads": runner.full_gradients()}
    except BaseException as error:  # noqa: BLE001  reported by the parent, with every rank's
        result = {"error": f"{type(error).__name__}: {error}"}
    torch.save(result, folder / f"rank{rank}.pt")
    os._exit(0)  # no close(): a broken group must not block the exit on a peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the comparison -------------------------------------------------------------------------------

def _made_from_data(nodes: list) -> set:
    """The nodes computed from the inputs or the parameters. The others are made from sizes
    alone (`arange(batch)`, a causal mask): each rank makes its own from its local sizes, which
    is what its consumers need but no slice of the one-device value, so they are not compared
    (their consumers are)."""
    made = set()
    for node in nodes:  # a size (`sym_size`) is not data: only tensors carry it on
        if node.op in ("placeholder", "get_attr") or any(a in made for a in node.all_input_nodes):
            if isinstance(node.meta.get("val"), torch.Tensor) or node.op == "placeholder":
                made.add(node)
    return made


def _sequence_flattened(program: Program) -> set[str]:
    """Nodes split over cp along a dim into which the sequence is flattened with another
    (`logits.view(B * T, V)`): each rank holds its slice of every row's sequence, side by side,
    not one stretch of the flattened dim, so no concatenation of the pieces is the one-device
    value. They are not compared; the values they are made from and make are."""
    flattened = set()
    seq = program.graph_module.meta.get(meta.GRAPH_SEQ, frozenset())
    for node in program.graph_module.graph.nodes:
        placement = meta.placement(node, "cp") if isinstance(node.meta.get("val"), torch.Tensor) else None
        if isinstance(placement, Shard):
            size = node.meta["val"].shape[placement.dim]
            if not (isinstance(size, torch.SymInt) and size.node.expr in seq):
                flattened.add(node.name)
    return flattened


def _in_rank_order(program: Program) -> set[str]:
    """Values inside a module that sorts the tokens of the batch (a mixture of experts sorts
    its (token, expert) pairs by expert) that do not leave it: each rank sorts its own tokens,
    so their order is the rank's, and no concatenation of the pieces is the one-device value.
    What the module gives back, in token order again, is compared; under ep, so are the
    expert weights, whatever the rows they are multiplied with."""
    graph = program.graph_module.graph
    sorting = {meta.module_path(n) for n in graph.nodes if n.op == "call_function"
               and getattr(n.target, "overloadpacket", None) is torch.ops.aten.sort
               and isinstance(meta.placement(n.args[0], "dp"), Shard)}

    def sorter(node: fx.Node) -> str | None:  # the sorting module `node` runs in, if any
        path = meta.module_path(node)
        return next((m for m in sorting if path == m or path.startswith(m + ".")), None)

    return {n.name for n in graph.nodes if n.op == "call_function" and (m := sorter(n)) is not None
            and isinstance(n.meta.get("val"), torch.Tensor) and isinstance(meta.placement(n, "dp"), Shard)
            and all(sorter(u) == m for u in n.users)}


def _held(ranks: list[dict], name: str, gradient: bool) -> dict[int, Pieces] | None:
    """Each rank's recorded pieces of node `name` (its gradients' with `gradient`), by rank;
    None where no rank recorded it, or a gradient is missing for a microbatch."""
    by_rank = {}
    for rank, result in enumerate(ranks):
        if name not in result["pieces"]:
            continue
        placements, values, grads = result["pieces"][name]
        if gradient:
            if len(grads) != len(values):
                return None
            values = [grads[k] for k in range(len(values))]
        by_rank[rank] = Pieces(placements, tuple(values))
    return by_rank or None


def _compare(program: Program, reference: Program, expected: dict, ranks: list[dict], names: set[str], *,
             rtol: float, atol: float) -> VerifyReport:
    mesh: Mesh = program.mesh
    nodes = [n for n in reference.graph_module.graph.nodes if n.name in names]
    report = VerifyReport(plan=str(program.plan), loss_reference=expected["loss"],
                          loss_parallel=ranks[0]["loss"], rtol=rtol, atol=atol)

    held = partial(_held, ranks)

    def check(what: str, node, want: torch.Tensor, got: torch.Tensor, spread: float) -> bool:
        report.compared[what] = report.compared.get(what, 0) + 1
        found = compare(want, got, spread, rtol=rtol, atol=atol)
        if found is None:
            report.closest = max(report.closest, tolerance_used(want, got, rtol=rtol, atol=atol))
            return True
        report.first = Difference(
            what=what, node=node.name, module_path=meta.module_path(node), code=node_code(node),
            reference=Stats.of(want), parallel=Stats.of(got), max_abs=found[0], max_relative=found[1],
            spread=spread, reason=found[2])
        return False

    from_data = _made_from_data(nodes)
    flattened = _sequence_flattened(program)
    rank_order = _in_rank_order(program)
    for node in nodes:  # 1. forward values
        if node not in from_data or node.name not in expected["values"] or (by_rank := held(node.name, False)) is None:
            continue
        if node.name in flattened or node.name in rank_order:
            why = ("values whose sequence cp flattens into another dim" if node.name in flattened
                   else "values in the order a rank sorted its tokens (a mixture of experts' dispatch)")
            report.left_out[why] = report.left_out.get(why, 0) + 1
            continue
        (want,) = expected["values"][node.name]
        got, spread = whole_value(by_rank, mesh, tuple(want.shape))
        if not check("forward value", node, want, got, spread):
            return report
    for node in reversed(nodes):  # 2. gradients of batch-dependent values
        grads = expected["grads"].get(node.name)
        if not grads or node.op == "get_attr" or (by_rank := held(node.name, True)) is None:
            continue
        if isinstance(next(iter(by_rank.values())).placements.dp, Replicate):
            continue  # a parameter's value: its gradient is checked reduced, below
        if node.name in flattened or node.name in rank_order:
            continue
        got, spread = whole_value(by_rank, mesh, tuple(grads[0].shape), gradient=True)
        if not check("gradient", node, grads[0], got, spread):
            return report
    reduced = ranks[0]["parameter_grads"]
    for node in reversed(nodes):  # 3. parameters' reduced gradients
        name = meta.parameter_name(node)
        if name is None or name not in expected["parameter_grads"] or name not in reduced:
            continue
        spread = max(float((r["parameter_grads"][name] - reduced[name]).abs().max()) for r in ranks)
        if not check("parameter gradient", node, expected["parameter_grads"][name], reduced[name], spread):
            return report
    return report
