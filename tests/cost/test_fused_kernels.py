"""`compile=inductor` priced by the kernels Inductor runs (`cost.fused_kernels`, `cost.compiled_graphs`).

The fusion rule on small graphs whose kernels can be counted by hand, then the estimate of a
compiled GPT: the same matmuls as eager mode (their shapes are the graph's, not the fusion's),
fewer bytes and launches, the recomputation of checkpoint regions in its own term, and under
bf16-mixed the partition traced in the dtype the graph computes in.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fxpar
from fxpar.cost.compiled_graphs import module_graphs, recomputed, stage_graphs, stage_module
from fxpar.cost.estimate import piece_times
from fxpar.cost.fused_kernels import extern_depth, kernels
from fxpar.cost.hardware import PROFILES
from fxpar.cost.layout import shares
from fxpar.cost.compiled_pieces import compiled_calls

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
ROWS, WIDTH = 8, 16
FP32 = 4


def _aten_graph(fn, *shapes):
    """`fn` as the aten graph make_fx records on fake inputs of `shapes` (fp32)."""
    with FakeTensorMode():
        inputs = [torch.empty(s) for s in shapes]
        return torch.fx.experimental.proxy_tensor.make_fx(fn)(*inputs)


def _kernels(fn, *shapes):
    return kernels(_aten_graph(fn, *shapes), sympy.sympify)


def test_a_softmax_is_one_kernel_reading_its_input_once_and_writing_its_output():
    found = _kernels(lambda x: torch.softmax(x * 2, dim=-1), (ROWS, WIDTH))
    assert [k.kind for k in found] == ["fused"]
    assert found[0].bytes == 2 * ROWS * WIDTH * FP32


def test_a_matmul_separates_the_ops_before_it_from_the_ops_after_it():
    def block(x, w):  # residual add and the norm after it; the next add behind the matmul
        h = x + 1
        y = F.layer_norm(h, (WIDTH,))
        return h + y @ w

    graph = _aten_graph(block, (ROWS, WIDTH), (WIDTH, WIDTH))
    found = kernels(graph, sympy.sympify)
    assert sorted(k.kind for k in found) == ["dense", "fused", "fused"]
    dense = next(k for k in found if k.kind == "dense")
    assert dense.shape == (ROWS, WIDTH, WIDTH)
    depths = {extern_depth(graph)[n] for n in graph.graph.nodes if n.target is torch.ops.aten.add.Tensor}
    assert depths == {0, 1}
    # Before: x in, h and the normalised y out. After: h and the product in, the sum out.
    assert sorted(k.bytes for k in found if k.kind == "fused") == [3 * ROWS * WIDTH * FP32] * 2


def test_a_view_between_two_ops_does_not_split_their_kernel():
    found = _kernels(lambda x: (x.exp().t() * 3).sum(0), (ROWS, WIDTH))
    assert [k.kind for k in found] == ["fused"]
    assert found[0].bytes == (ROWS * WIDTH + ROWS) * FP32


def test_a_value_of_an_op_returning_several_is_read_at_its_own_size():
    def normalised_product(x, w):
        var, mean = torch.var_mean(x, dim=-1, keepdim=True)  # one kernel, writes var
        return (x @ w) * var  # behind the matmul: reads the product and var

    found = _kernels(normalised_product, (ROWS, WIDTH), (WIDTH, WIDTH))
    first, second = sorted((k for k in found if k.kind == "fused"), key=lambda k: k.bytes)
    assert first.bytes == (ROWS * WIDTH + ROWS) * FP32
    assert second.bytes == (2 * ROWS * WIDTH + ROWS) * FP32


@pytest.fixture(scope="module")
def gpt():
    """The model and one capture of it, which every plan here compiles from (so each distinct
    rank module is partitioned once: `cost.compiled_graphs.module_graphs`)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 16))
    model = GPT(CONFIG)
    return model, fxpar.capture(model, (tokens, tokens.clone()))


def _compile(gpt, plan: str):
    return fxpar.compile(gpt[1], plan)


def _estimate(gpt, plan: str, hardware="h100"):
    return _compile(gpt, plan).estimate(hardware)


def test_compiled_mode_runs_the_matmuls_eager_mode_runs_in_fewer_kernels(gpt):
    model, _ = gpt
    program = _compile(gpt, "dp=2 compile=inductor")
    graphs = module_graphs(program, program.rank_module(0), 0)
    forward = kernels(graphs.forward, program.captured.readable)
    backward = kernels(graphs.backward, program.captured.readable)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    # Every linear's forward, and in backward its input's and its weight's gradients (the
    # first layer's input is the embedding's output, which needs one).
    assert sum(k.kind == "dense" for k in forward) == linears
    assert sum(k.kind == "dense" for k in backward) == 2 * linears
    assert sum(k.kind == "attention" for k in forward) == CONFIG.n_layer
    eager_ops = sum(1 for n in program.rank_module(0).graph.nodes if n.op == "call_function")
    assert len(forward) < eager_ops / 2


def test_compiled_time_is_its_kernels_and_eager_time_its_ops(gpt):
    """On a profile where a launch costs what an op does, compiled mode is the cheaper: the
    same matmuls, fewer bytes and fewer launches; each kernel of the two graphs pays one."""
    device = replace(PROFILES["h100"], kernel_launch=PROFILES["h100"].op_overhead)
    eager = _estimate(gpt, "dp=2", device)
    compiled = _estimate(gpt, "dp=2 compile=inductor", device)
    assert 0 < compiled.time["compute"] < eager.time["compute"]
    program = _compile(gpt, "dp=2 compile=inductor")
    graphs = module_graphs(program, program.rank_module(0), 0)
    counts = {phase: len(kernels(getattr(graphs, phase), program.captured.readable))
              for phase in ("forward", "backward")}
    assert compiled.kernels == counts and eager.kernels is None  # what the report shows
    assert f"{counts['forward']} forward, {counts['backward']} backward" in compiled.table()
    launched = sum(counts.values())
    slow = _estimate(gpt, "dp=2 compile=inductor", replace(device, kernel_launch=1e-3))
    extra = launched * (1e-3 - device.kernel_launch)
    assert slow.time["compute"] - compiled.time["compute"] == pytest.approx(extra, rel=1e-9)


def test_checkpointed_regions_run_again_in_the_compiled_backward(gpt):
    program = _compile(gpt, "dp=2 compile=inductor checkpoint=full")
    graphs = module_graphs(program, program.rank_module(0), 0)
    again = [k for k in kernels(graphs.backward, program.captured.readable, recomputed) if k.recomputed]
    # The forward's linears (addmm: with their bias) run again; the gradients' matmuls (mm) are
    # the backward's own. The last block's last linear is not recomputed: no gradient needs
    # its output, so the partitioner keeps none of it.
    forward_linears = [n for n in graphs.backward.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert len(forward_linears) == 6 * CONFIG.n_layer - 1  # q, k, v, proj, fc, its proj
    assert sum(k.kind == "dense" for k in again) == len(forward_linears)
    assert _estimate(gpt, "dp=2 compile=inductor checkpoint=full").time["recompute"] > 0
    assert _estimate(gpt, "dp=2 compile=inductor").time["recompute"] == 0


def test_bf16_mixed_is_partitioned_in_the_dtype_the_graph_computes_in(gpt):
    """`bind` makes each fp32 parameter a bf16 working copy: the compiled graphs Inductor is
    given, and so the activations they keep, are bf16 (they were fp32, twice the bytes)."""
    program = _compile(gpt, "dp=2 precision=bf16-mixed compile=inductor")
    graphs = module_graphs(program, program.rank_module(0), 0)
    products = [n.meta["val"].dtype for n in graphs.forward.graph.nodes
                if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert products and set(products) == {torch.bfloat16}
    fp32 = _estimate(gpt, "dp=2 compile=inductor")
    bf16 = _estimate(gpt, "dp=2 precision=bf16-mixed compile=inductor")
    assert bf16.memory["activations"] < 0.75 * fp32.memory["activations"]


def test_a_compiled_zero_bubble_stage_runs_its_weight_gradients_apart_priced_as_in_eager_mode(gpt):
    """Under `schedule=zb-h1 compile=inductor` the deferred linears run op by op between the
    compiled pieces (`runtime.compiled_segments`): W is their weight-gradient matmuls at
    eager mode's price, B the rest of the compiled backward, and each forward and backward
    pays a host call per compiled piece and an op's overhead per op run between them."""
    compiled, eager = (_compile(gpt, f"pp=2 mb=2 schedule=zb-h1{mode}") for mode in (" compile=inductor", ""))
    device, sizes = PROFILES["h100"], dict(compiled.captured.example_sizes)
    timed = [piece_times(p, shares(p), device, "fp32").values() for p in (compiled, eager)]
    for (_, backward, weight, _), (_, _, eager_weight, _) in zip(*timed, strict=True):
        assert weight == eager_weight != 0
        assert float(backward.subs(sizes)) > float(weight.subs(sizes))  # B is what is left
    # Each forward and backward pays its calls: the compiled pieces and the ops run between them.
    quiet = replace(device, compiled_call=0.0, op_overhead=0.0)
    for share, timed, silent in zip(shares(compiled), timed[0], piece_times(compiled, shares(compiled), quiet, "fp32").values()):
        pieces, ops = compiled_calls(stage_module(compiled, share.stage)[1])
        assert pieces >= 2 and ops >= 4  # (a block: its linears, and the views and attention between q, k and v)
        host = 2 * (pieces * device.compiled_call + ops * device.op_overhead)  # 2 microbatches
        assert float((timed[0] - silent[0]).subs(sizes)) == pytest.approx(host)


def test_a_backward_that_saves_no_symbolic_size_is_partitioned_too(gpt):
    """AOTAutograd lowers such a backward lazily, at its first run (the last stage of a
    pipeline under full checkpointing); the partition has it lowered at once, so the plan is
    priced (it raised a KeyError, and the planner with it)."""
    program = _compile(gpt, "pp=2 mb=2 checkpoint=full compile=inductor")
    last = stage_graphs(program, 1)
    assert any(recomputed(n) for n in last.backward.graph.nodes)
    assert program.estimate("h100").time["recompute"] > 0
