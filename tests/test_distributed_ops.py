"""The distributed ops do what their one description says: registered and eager forms issue
the same collectives, which are the ones `fxpar.collectives` predicts from that description;
fake kernels give the real shapes; torch.library.opcheck accepts every op."""

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fxpar  # noqa: F401  (registers the ops)
from fxpar import meta
from fxpar.axes import bind_axes, unbind_axes
from fxpar.lowering import graph_calls
from fxpar.distributed_ops import EAGER, OPS
from fxpar.mesh import Mesh
from fxpar.placement import P, Placements, R, Shard
from fxpar.step_program import evaluate

SIZE, INDEX = 2, 1


class RecordingAxis:
    """Axis "tp" of two ranks seen from rank 1, whose peer holds the same tensor: what each
    collective would compute, and a log of (kind, payload elements, reduce op, tag, phase)."""

    size, index = SIZE, INDEX

    def __init__(self):
        self.log = []

    def all_reduce(self, tensor, *, op, tag, phase):
        self.log.append(("all_reduce", tensor.numel(), op, tag, phase))
        if op == "sum":
            tensor.mul_(SIZE)

    def all_gather(self, output, tensor, *, tag, phase):
        self.log.append(("all_gather", output.numel(), "none", tag, phase))
        output.copy_(torch.cat([tensor] * SIZE))

    def reduce_scatter(self, output, tensor, *, tag, phase):
        self.log.append(("reduce_scatter", tensor.numel(), "sum", tag, phase))
        output.copy_(tensor.chunk(SIZE)[INDEX] * SIZE)


@pytest.fixture
def axis():
    recording = RecordingAxis()
    bind_axes({"tp": recording})
    yield recording
    unbind_axes()


# (op, the input's placement before, its placement after)
CASES = {
    "all_reduce": (P, R), "all_reduce_max": (P, R), "copy_to_region": (R, R),
    "split_to_shard": (R, Shard(1)), "all_gather": (Shard(1), R),
    "gather_to_region": (Shard(1), R), "reduce_scatter": (P, Shard(1)),
}


def _args(op, x):
    return (x, "tp", SIZE, 1) if op.takes_dim else (x, "tp")


def _predicted(op, x_shape, placements):
    """What fxpar.collectives predicts for a graph holding this one op."""
    graph = fx.Graph()
    source = graph.placeholder("x")
    with FakeTensorMode() as fake:
        whole = list(x_shape)
        if isinstance(placements[0], Shard):
            whole[1] *= SIZE  # the global value the shard is a piece of
        source.meta["val"] = fake.from_tensor(torch.empty(whole))
    source.meta[meta.PLACEMENT] = Placements(tp=placements[0])
    source.meta[meta.REQUIRES_GRAD] = op.backward is not None
    node = graph.call_function(op.overload, _args(op, source))
    node.meta.update({"val": source.meta["val"], meta.PLACEMENT: Placements(tp=placements[1])})
    graph.output(node)
    forward, backward = graph_calls(fx.GraphModule({}, graph), Mesh(tp=SIZE))
    return [(c.kind, evaluate(c.numel, {}), c.op, c.tag, c.phase) for c in (*forward, *backward)]


@pytest.mark.parametrize("name", [op.name for op in OPS])
def test_registered_and_eager_forms_issue_the_predicted_collectives(name, axis):
    op = next(o for o in OPS if o.name == name)
    logs, outputs, grads = [], [], []
    # The registered op, its eager form, and the eager form that reduces in place (given a
    # fresh tensor, as `lower_for_eager` only allows then).
    for run in (op.overload, EAGER[(op.overload, False)], EAGER[(op.overload, True)]):
        leaf = torch.arange(24.0).reshape(2, 4, 3).requires_grad_(op.backward is not None)
        x = leaf * 1 if op.backward is not None else leaf.clone()
        axis.log.clear()
        out = run(*_args(op, x))
        if op.backward is not None:
            out.backward(torch.ones_like(out))
            grads.append(leaf.grad)
        logs.append(list(axis.log))
        outputs.append(out.detach())
    assert logs[0] == logs[1] == logs[2] == _predicted(op, (2, 4, 3), CASES[name])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    torch.testing.assert_close(outputs[0], outputs[2], rtol=0, atol=0)
    for other in grads[1:]:
        torch.testing.assert_close(grads[0], other, rtol=0, atol=0)


@pytest.mark.parametrize("name", [op.name for op in OPS])
def test_fake_kernels_give_the_real_shapes(name, axis):
    op = next(o for o in OPS if o.name == name)
    real = op.overload(*_args(op, torch.zeros(2, 4, 6)))
    with FakeTensorMode() as fake:
        shape = op.overload(*_args(op, fake.from_tensor(torch.zeros(2, 4, 6)))).shape
    assert shape == real.shape


@pytest.mark.parametrize("name", [op.name for op in OPS])
def test_opcheck_accepts_every_op(name, axis):
    op = next(o for o in OPS if o.name == name)
    x = torch.randn(2, 4, 6, requires_grad=op.backward is not None)
    torch.library.opcheck(op.overload, _args(op, x),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
