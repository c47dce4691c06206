"""A compiled backward's collectives are started, computed around and waited for: the two halves
of `ops.collective_primitives.started` do what the whole primitive does, the wait is where the
binding's call completes, and `runtime.collective_schedule` moves the work that does not need a
call between its start and its wait without reordering the calls."""

import torch
import torch.fx as fx

import fxpar  # noqa: F401  (registers the ops)
from fxpar.ir.axes import bind_axes, unbind_axes
from fxpar.ops.collective_primitives import recomputable, run, started
from fxpar.runtime.collective_schedule import START, WAIT, schedule_collectives

SIZE, INDEX = 2, 1


class _Call:
    def __init__(self, events, finish):
        self.events, self.finish = events, finish

    def wait(self):
        self.events.append("waited")
        self.finish()


class StartingAxis:
    """Axis "tp" of two ranks seen from rank 1, whose peer holds the same tensor, that starts
    its calls and completes them only when waited for (as a process group's do)."""

    size, index = SIZE, INDEX

    def __init__(self):
        self.events = []

    def start_all_reduce(self, tensor, *, op, tag, phase):
        self.events.append(("all_reduce", tag, phase))
        return _Call(self.events, lambda: tensor.mul_(SIZE))

    def start_all_gather(self, output, tensor, *, tag, phase):
        self.events.append(("all_gather", tag, phase))
        return _Call(self.events, lambda: output.copy_(torch.cat([tensor] * SIZE)))

    def start_reduce_scatter(self, output, tensor, *, tag, phase):
        self.events.append(("reduce_scatter", tag, phase))
        return _Call(self.events, lambda: output.copy_(tensor.chunk(SIZE)[INDEX] * SIZE))

    # what `run` uses where a binding has no start_* (tests/test_distributed_ops.py): unused here
    all_reduce = all_gather = reduce_scatter = None


def test_started_halves_equal_the_whole_primitive_and_wait_where_the_graph_waits():
    axis = StartingAxis()
    bind_axes({"tp": axis})
    try:
        x = torch.arange(24.0).reshape(2, 4, 3)
        for primitive, dim in (("all_reduce", 0), ("all_gather", 1), ("reduce_scatter", 1)):
            axis.events.clear()
            buffer = torch.ops.fxpar.collective_start(x, "tp", SIZE, dim, primitive, "sum", "t", "backward")
            assert axis.events == [(primitive, "t", "backward")]  # started, not waited for
            torch.ops._c10d_functional.wait_tensor(buffer)
            assert axis.events[-1] == "waited"
            whole = run(primitive, x, "tp", SIZE, dim, "sum", "t", "backward")
            torch.testing.assert_close(started(primitive, x, "tp", SIZE, dim, "t", "backward"), whole,
                                       rtol=0, atol=0)
        torch.testing.assert_close(run("all_gather", x, "tp", SIZE, 1, "sum", "t", "backward"),
                                   torch.cat([x, x], dim=1), rtol=0, atol=0)
    finally:
        unbind_axes()


def _backward_like_graph() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """Two column-parallel linears' backward as Inductor sees it before the pass: each layer's
    input gradient, its weight gradient, then the all-reduce of the input gradient and its wait,
    which the next layer reads."""
    graph = fx.Graph()
    grad, weight, saved = graph.placeholder("grad"), graph.placeholder("weight"), graph.placeholder("saved")
    nodes = {}
    current = grad
    for layer in (1, 2):
        nodes[f"input_grad{layer}"] = graph.call_function(torch.ops.aten.mm.default, (current, weight))
        nodes[f"weight_grad{layer}"] = graph.call_function(torch.ops.aten.mm.default, (current, saved))
        nodes[f"start{layer}"] = graph.call_function(
            START, (nodes[f"input_grad{layer}"], "tp", 2, 0, "all_reduce", "sum", f"f{layer}", "backward"))
        nodes[f"wait{layer}"] = current = graph.call_function(WAIT, (nodes[f"start{layer}"],))
    graph.output((current, nodes["weight_grad1"], nodes["weight_grad2"]))
    return graph, nodes


def test_schedule_starts_a_call_before_the_work_that_does_not_need_it():
    graph, nodes = _backward_like_graph()
    schedule_collectives(graph)
    order = [n.name for n in graph.nodes if n.op == "call_function"]
    name = {key: node.name for key, node in nodes.items()}
    assert order == [name[k] for k in ("input_grad1", "start1", "weight_grad1", "wait1",
                                       "input_grad2", "start2", "weight_grad2", "wait2")]


GATHER_TAGS = recomputable("dp gather_parameters", "dp regather_parameters (backward)")  # (TracedGather's)


def _zero3_forward_graph() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """Two ZeRO-3 layers under tp, as Inductor sees their forward before the pass: each layer's
    gather (its shards laid out, started, waited for), then its matmul and its tp all-reduce."""
    graph = fx.Graph()
    x, shards = graph.placeholder("x"), [graph.placeholder(f"shard{i}") for i in (1, 2)]
    nodes = {}
    current = x
    for layer, shard in zip((1, 2), shards):
        nodes[f"lay_out{layer}"] = graph.call_function(torch.ops.aten.clone.default, (shard,))
        nodes[f"gather{layer}"] = graph.call_function(
            START, (nodes[f"lay_out{layer}"], "dp", 2, 0, "all_gather", "sum", GATHER_TAGS, "forward"))
        nodes[f"gathered{layer}"] = graph.call_function(WAIT, (nodes[f"gather{layer}"],))
        nodes[f"matmul{layer}"] = graph.call_function(torch.ops.aten.mm.default, (current, nodes[f"gathered{layer}"]))
        nodes[f"reduce{layer}"] = graph.call_function(
            START, (nodes[f"matmul{layer}"], "tp", 2, 0, "all_reduce", "sum", f"g{layer}", "forward"))
        nodes[f"reduced{layer}"] = current = graph.call_function(WAIT, (nodes[f"reduce{layer}"],))
    graph.output(current)
    return graph, nodes


def test_zero3_gathers_a_layer_while_the_one_before_computes_or_where_it_reads():
    """prefetch=1: the second layer's gather goes out right after the first's completed, ahead
    of the first layer's matmul and all-reduce (the call order `lowering.prefetched` writes),
    and is waited for where the second layer reads it; prefetch=0 leaves it there."""
    for ahead, expected in ((1, ("lay_out1", "gather1", "gathered1", "lay_out2", "gather2", "matmul1",
                                 "reduce1", "reduced1", "gathered2", "matmul2", "reduce2", "reduced2")),
                            (0, ("lay_out1", "gather1", "gathered1", "matmul1", "reduce1", "reduced1",
                                 "lay_out2", "gather2", "gathered2", "matmul2", "reduce2", "reduced2"))):
        graph, nodes = _zero3_forward_graph()
        schedule_collectives(graph, gathers_ahead=ahead)
        name = {node.name: key for key, node in nodes.items()}
        assert tuple(name[n.name] for n in graph.nodes if n.op == "call_function") == expected


def test_schedule_keeps_the_calls_order_and_leaves_lone_starts():
    graph, nodes = _backward_like_graph()
    with graph.inserting_before(graph.output_node()):
        graph.call_function(START, (nodes["wait2"], "tp", 2, 0, "all_reduce", "sum", "lone", "backward"))
    schedule_collectives(graph)  # lints: every node after its inputs
    starts = [n.args[6] for n in graph.nodes if n.target is START]
    assert starts == ["f1", "f2", "lone"]


def test_modules_that_communicate_compile_with_the_schedule_and_others_with_inductors_defaults():
    """The schedule (and Inductor's memory reordering off, which would undo it) where a graph of
    the module runs a traced collective, checkpoint regions included; defaults elsewhere."""
    from fxpar.ops.traced_collectives import TRACED
    from fxpar.runtime.collective_schedule import compile_options
    from fxpar.runtime.step.recompute import RecomputedRegion

    def module(target) -> fx.GraphModule:
        graph = fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(target, (x, "tp")))
        return fx.GraphModule({}, graph)

    traced = module(TRACED[torch.ops.fxpar.all_reduce.default])
    options = compile_options(traced, gathers_ahead=1)
    assert options["reorder_for_peak_memory"] is False
    assert options["post_grad_custom_post_pass"].gathers_ahead == 1
    assert compile_options(module(torch.ops.aten.relu.default), gathers_ahead=1) == {}
    wrapper = torch.nn.Module()
    wrapper.recompute_0 = RecomputedRegion(traced, None)
    assert compile_options(wrapper, gathers_ahead=0)["post_grad_custom_post_pass"].gathers_ahead == 0
