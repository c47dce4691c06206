"""The step's count of valid targets arrives during the forward (`runtime.step.valid_targets`):
the bound graph waits for it right where the loss reads it, once a step, and a graph without
a count is left alone. (That the values and the step agreement are the blocking path's is
the multi-rank tests': test_data_parallel_equivalence, test_failures.)"""

import torch
import torch.fx as fx

from fxpar.ir.loss_reduction import COUNT_INPUT
from fxpar.runtime.step.valid_targets import ARRIVED, CountArrival, await_count


def _loss_graph() -> fx.GraphModule:
    graph = fx.Graph()
    total, count = graph.placeholder("total"), graph.placeholder(COUNT_INPUT)
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (total, 2.0))
    graph.output(graph.call_function(torch.ops.aten.div.Tensor, (doubled, count)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_graph_waits_for_the_count_where_it_reads_it_once_a_step():
    arrival = CountArrival()
    gm = await_count(_loss_graph(), arrival)
    order = [n.name for n in gm.graph.nodes]
    assert order.index(ARRIVED) == len(order) - 3  # just before the division (then the output)
    assert order.index(ARRIVED) > order.index("mul_tensor")  # the multiply ran meanwhile
    settled = []

    def settle():
        settled.append(True)
        return torch.tensor(4, dtype=torch.int64)  # the sum over the group, as the all-reduce gives it

    count = arrival.expect(settle, torch.float32, torch.device("cpu"))
    assert gm(torch.tensor(6.0), count) == 3.0 and count.dtype == torch.float32
    assert gm(torch.tensor(6.0), count) == 3.0  # a second microbatch: already here
    arrival.settle()  # the executors' call before backward: nothing left to wait for
    assert settled == [True]


def test_a_count_given_directly_and_a_graph_without_one_are_left_as_they_are():
    arrival = CountArrival()
    gm = await_count(_loss_graph(), arrival)
    assert gm(torch.tensor(6.0), torch.tensor(2.0)) == 6.0  # dp=1: the count is the rank's own
    graph = fx.Graph()
    graph.output(graph.call_function(torch.ops.aten.neg.default, (graph.placeholder("x"),)))
    plain = fx.GraphModule(torch.nn.Module(), graph)
    before = plain.code
    assert await_count(plain, arrival).code == before
