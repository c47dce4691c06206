"""The distributed ops do what their one description says: registered and eager forms issue
the same collectives, which are the ones `fxpar.ir.collectives` predicts from that description;
fake kernels give the real shapes; torch.library.opcheck accepts every op. ZeRO-3's two ops,
which move a list of parameter pieces as one payload, are tested the same way at the end."""

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fxpar  # noqa: F401  (registers the ops)
from fxpar.compiler.lowering import graph_calls
from fxpar.ir import meta
from fxpar.ir.axes import bind_axes, unbind_axes
from fxpar.ir.mesh import Mesh
from fxpar.ir.placement import P, Placements, R, Shard
from fxpar.ir.step_program import evaluate
from fxpar.ops.distributed import EAGER, OPS

SIZE, INDEX = 2, 1


class RecordingAxis:
    """Axis "tp" of two ranks seen from rank 1, whose peer holds the same tensor: what each
    collective would compute, and a log of (kind, payload elements, reduce op, tag, phase)."""

    size, index = SIZE, INDEX

    def __init__(self):
        self.log = []
        self.read = []  # the storage each call read its input from

    def all_reduce(self, tensor, *, op, tag, phase):
        self.read.append(tensor.untyped_storage().data_ptr())
        self.log.append(("all_reduce", tensor.numel(), op, tag, phase))
        if op == "sum":
            tensor.mul_(SIZE)

    def all_gather(self, output, tensor, *, tag, phase):
        self.read.append(tensor.untyped_storage().data_ptr())
        self.log.append(("all_gather", output.numel(), "none", tag, phase))
        output.copy_(torch.cat([tensor] * SIZE))

    def reduce_scatter(self, output, tensor, *, tag, phase):
        self.read.append(tensor.untyped_storage().data_ptr())
        self.log.append(("reduce_scatter", tensor.numel(), "sum", tag, phase))
        output.copy_(tensor.chunk(SIZE)[INDEX] * SIZE)

    def all_to_all(self, output, tensor, *, tag, phase, output_splits=None, input_splits=None):
        assert output_splits is None and input_splits is None  # (the routed op: test_expert_parallel_equivalence)
        self.read.append(tensor.untyped_storage().data_ptr())
        self.log.append(("all_to_all", tensor.numel(), "none", tag, phase))
        output.copy_(torch.cat([tensor.chunk(SIZE)[INDEX]] * SIZE))


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
    "gather_to_region": (Shard(1), R), "reduce_scatter": (P, Shard(1)), "all_to_all": (Shard(1), Shard(1)),
}


def _args(op, x):
    return (x, "tp", SIZE, 1) if op.takes_dim else (x, "tp")


def _predicted(op, x_shape, placements):
    """What fxpar.ir.collectives predicts for a graph holding this one op."""
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


@pytest.mark.parametrize("name", [op.name for op in OPS if op.standard])
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


@pytest.mark.parametrize("primitive", ["all_gather", "reduce_scatter", "all_to_all", "all_reduce"])
def test_a_started_collective_reads_a_copy_of_its_input(primitive, axis):
    """A compiled graph's collective reads its input until its wait, while Inductor may give the
    input's memory to other kernels (`collective_primitives._collective_start`): each call reads
    a copy, even of a contiguous input it could have read in place."""
    x = torch.arange(8.0).reshape(4, 2)
    buffer = torch.ops.fxpar.collective_start(x, "tp", SIZE, 0, primitive, "sum", "tag", "forward")
    torch.ops._c10d_functional.wait_tensor(buffer)
    assert axis.read and x.untyped_storage().data_ptr() not in axis.read


@pytest.mark.parametrize("name", [op.name for op in OPS if op.standard])
def test_fake_kernels_give_the_real_shapes(name, axis):
    op = next(o for o in OPS if o.name == name)
    real = op.overload(*_args(op, torch.zeros(2, 4, 6)))
    with FakeTensorMode() as fake:
        shape = op.overload(*_args(op, fake.from_tensor(torch.zeros(2, 4, 6)))).shape
    assert shape == real.shape


@pytest.mark.parametrize("name", [op.name for op in OPS if op.standard])
def test_opcheck_accepts_every_op(name, axis):
    op = next(o for o in OPS if o.name == name)
    x = torch.randn(2, 4, 6, requires_grad=op.backward is not None)
    torch.library.opcheck(op.overload, _args(op, x),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# -- ZeRO-3's ops: a list of pieces, one flat payload ---------------------------------------------

def _pieces():
    return [torch.arange(3.0).requires_grad_(), torch.arange(5.0).requires_grad_()]


def _predicted_zero3(op_name: str) -> list:
    """What lowering predicts for a graph holding one ZeRO-3 op over pieces of 3 and 5."""
    graph = fx.Graph()
    sources = []
    with FakeTensorMode() as fake:
        for i, n in enumerate((3, 5)):
            node = graph.placeholder(f"piece{i}")
            node.meta.update({"val": fake.from_tensor(torch.empty(n)), meta.REQUIRES_GRAD: True})
            sources.append(node)
        x = graph.placeholder("x")
        x.meta.update({"val": fake.from_tensor(torch.empty(4)), meta.REQUIRES_GRAD: True})
    target = getattr(torch.ops.fxpar, op_name).default
    args = (sources, "tp", SIZE) if op_name == "gather_parameters" else (x, sources, "tp", SIZE)
    node = graph.call_function(target, args)
    graph.output(node)
    forward, backward = graph_calls(fx.GraphModule({}, graph), Mesh(tp=SIZE))
    return [(c.kind, evaluate(c.numel, {}), c.op, c.tag, c.phase) for c in (*forward, *backward)]


def test_gather_parameters_gathers_forward_and_reduce_scatters_backward_as_predicted(axis):
    pieces = _pieces()
    whole = torch.ops.fxpar.gather_parameters(pieces, "tp", SIZE)
    assert [w.tolist() for w in whole] == [[0, 1, 2] * SIZE, [0, 1, 2, 3, 4] * SIZE]  # every rank's piece
    sum(w.sum() for w in whole).backward()
    assert all(torch.equal(p.grad, torch.full_like(p, SIZE)) for p in pieces)  # summed over ranks
    assert axis.log == _predicted_zero3("gather_parameters") == [
        ("all_gather", 16, "none", "tp gather_parameters", "forward"),
        ("reduce_scatter", 16, "sum", "tp gather_parameters (backward)", "backward"),
    ]


def test_regather_parameters_passes_the_gradient_and_gathers_again_backward(axis):
    pieces, x = _pieces(), torch.ones(4, requires_grad=True)
    out = torch.ops.fxpar.regather_parameters(x, pieces, "tp", SIZE)
    assert torch.equal(out, x) and not axis.log  # forward: nothing moves
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(4))
    assert axis.log == _predicted_zero3("regather_parameters") == [
        ("all_gather", 16, "none", "tp regather_parameters (backward)", "backward")]


def test_zero3_ops_have_real_shapes_under_fake_tensors_and_pass_opcheck(axis):
    with FakeTensorMode() as fake:
        shapes = [t.shape for t in torch.ops.fxpar.gather_parameters(
            [fake.from_tensor(p.detach()) for p in _pieces()], "tp", SIZE)]
    assert shapes == [torch.Size([6]), torch.Size([10])]
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.fxpar.gather_parameters.default, (_pieces(), "tp", SIZE), test_utils=checks)
    torch.library.opcheck(torch.ops.fxpar.regather_parameters.default,
                          (torch.ones(4, requires_grad=True), _pieces(), "tp", SIZE), test_utils=checks)


def test_gather_parameters_in_another_dtype_reduce_scatters_in_the_pieces_dtype(axis):
    """bf16-mixed ZeRO-3 with reduce_dtype=fp32: fp32 pieces gathered as bf16, the bf16
    gradients summed in fp32 into fp32 piece gradients; lowering lists the same dtypes."""
    pieces = _pieces()
    whole = torch.ops.fxpar.gather_parameters(pieces, "tp", SIZE, dtype=torch.bfloat16)
    assert [w.dtype for w in whole] == [torch.bfloat16] * 2
    sum((w.float() * 0.5).sum() for w in whole).backward()
    assert all(p.grad.dtype == torch.float32 and torch.equal(p.grad, torch.full_like(p, SIZE * 0.5)) for p in pieces)
    graph = fx.Graph()
    with FakeTensorMode() as fake:
        sources = []
        for i, n in enumerate((3, 5)):
            node = graph.placeholder(f"piece{i}")
            node.meta.update({"val": fake.from_tensor(torch.empty(n)), meta.REQUIRES_GRAD: True})
            sources.append(node)
    node = graph.call_function(torch.ops.fxpar.gather_parameters.default, (sources, "tp", SIZE),
                               {"dtype": torch.bfloat16})
    graph.output(node)
    forward, backward = graph_calls(fx.GraphModule({}, graph), Mesh(tp=SIZE))
    assert [(c.kind, c.dtype) for c in (*forward, *backward)] == [
        ("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)]
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.fxpar.gather_parameters.default, (_pieces(), "tp", SIZE),
                          {"dtype": torch.bfloat16}, test_utils=checks)
    torch.library.opcheck(torch.ops.fxpar.regather_parameters.default,
                          (torch.ones(4, requires_grad=True), _pieces(), "tp", SIZE), {"dtype": torch.bfloat16},
                          test_utils=checks)
