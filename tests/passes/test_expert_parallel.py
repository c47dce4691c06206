"""Expert parallelism's rewrite (`passes.expert_parallel`) on a Hugging Face Mixtral, and its refusals.

Under `dp=2 ep=2` a rank holds two of each layer's four experts. By default each routed row
goes to the rank of its expert by all-to-all, after the counts are exchanged, and its result
comes back the same way; with `dispatch=allgather` the grouped matmuls read the rows of the
expert group's gathered tokens with offsets of its own experts, and their results are
reduce-scattered back. The experts' gradients are summed over edp, the ranks that hold the
same experts, outside dp's buckets. (Trained against one device: tests/runtime/test_expert_parallel_equivalence.py.)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import Shard
from fxpar.ir.step_program import Purpose
from fxpar.ops.expert_routing import is_grouped_mm

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_models import build  # noqa: E402

EXPERTS = tuple(f"model.model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj"))


@pytest.fixture(scope="module")
def mixtral():
    model, inputs = build("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, inputs, fxpar.capture(model, inputs)


def _targets(module) -> list[str]:
    return [str(n.target) for n in module.graph.nodes if n.op == "call_function"]


def test_each_rank_holds_half_the_experts_and_runs_them_on_the_groups_rows(mixtral):
    _, _, captured = mixtral
    program = fxpar.compile(captured, "dp=2 ep=2")
    graph = program.graph_module.graph
    assert set(meta.partial_gradient_parameters(graph, "edp")) == set(EXPERTS)
    bucketed = {n for b in program.buckets for n in b.parameters}
    assert not bucketed & set(EXPERTS) and set(EXPERTS) <= meta.trained_parameters(program.graph_module)
    for rank in (0, 1):
        module = program.rank_module(rank)
        assert module.get_parameter(EXPERTS[0]).shape == (2, 256, 64)  # 2 of 4 experts, gate|up by width
        assert module.get_parameter("model.model.layers.0.mlp.gate.weight").shape == (4, 64)  # the router whole
        targets = _targets(module)
        assert targets.count("fxpar.all_to_all.default") == 2  # each layer's counts per expert
        assert targets.count("fxpar.all_to_all_rows.default") == 4  # its rows there and back
        assert targets.count("fxpar.expert_order.default") == 2
    for node in graph.nodes:
        if is_grouped_mm(node):
            assert meta.placement(node.args[1], "ep") == Shard(0)
    # predicted at uniform routing: the rank's 4 x 16 tokens' two rows each, of 64 floats, both
    # ways in forward and backward; the counts exchanged in full
    calls = [c for c in program.collectives(0) if c.kind == "all_to_all"]
    assert [c.numel for c in calls if c.routed] == [64 * 2 * 64] * 8
    assert [(c.numel, c.dtype) for c in calls if not c.routed] == [(4, torch.int64)] * 2


def test_tp_splits_each_expert_as_a_dense_mlp(mixtral):
    """`tp_rules=infer`: each layer's grouped matmuls are an MLP pair, the (experts, 2I, H)
    gate|up weights split on their output features in two blocks, the (experts, H, I) down
    weights on their input features; under ep too, behind the experts' own split."""
    _, _, captured = mixtral
    program = fxpar.compile(captured, "dp=2 ep=2 tp=2 tp_rules=infer")
    nodes = meta.parameter_nodes(program.graph_module.graph)
    gate_up, down = (nodes[f"model.model.layers.0.mlp.experts.{w}"] for w in ("gate_up_proj", "down_proj"))
    assert meta.placement(gate_up, "tp") == Shard(1, parts=2) and meta.placement(down, "tp") == Shard(2)
    assert meta.placement(gate_up, "ep") == meta.placement(down, "ep") == Shard(0)
    module = program.rank_module(1)
    assert module.get_parameter(EXPERTS[0]).shape == (2, 128, 64)  # 2 experts, half of gate and of up each
    assert module.get_parameter(EXPERTS[1]).shape == (2, 64, 64)


def test_the_all_gather_dispatcher_gathers_the_groups_tokens(mixtral):
    _, _, captured = mixtral
    program = fxpar.compile(captured, "dp=2 ep=2 dispatch=allgather")
    for rank in (0, 1):
        module = program.rank_module(rank)
        assert module.get_parameter(EXPERTS[0]).shape == (2, 256, 64)
        targets = _targets(module)
        assert targets.count("fxpar.gather_to_region.default") == 2  # the tokens, once per layer
        assert targets.count("fxpar.all_gather.default") == 4  # their rows' expert ids and token indices
        assert targets.count("fxpar.group_rows.default") == 2
        assert targets.count("fxpar.reduce_scatter.default") == 2  # the results back
        assert targets.count("fxpar.local_experts.default") == 2


def test_the_experts_gradients_are_summed_over_the_ranks_holding_them(mixtral):
    """dp=4 ep=2: two expert groups; each expert's gradient is one all-reduce over edp, the
    dense gradients DDP's buckets over dp."""
    _, _, captured = mixtral
    program = fxpar.compile(captured, "dp=4 ep=2")
    assert program.mesh.sizes["edp"] == 2
    actions = [a for a in program.step_program(0).actions if getattr(a, "purpose", None) is Purpose.PARTIAL_GRADIENTS]
    (call,) = [a.calls[0] for a in actions]
    experts = sum(captured.graph_module.get_parameter(n).numel() for n in EXPERTS)
    assert (call.axis, call.numel) == ("edp", experts // 2)
    assert program.mesh.group(1, "edp") == (1, 3) and program.mesh.group(1, "ep") == (0, 1)


def test_expert_weights_and_their_optimizer_state_halve_in_the_estimate(mixtral):
    _, _, captured = mixtral
    dense = fxpar.compile(captured, "dp=2").estimate().memory
    split = fxpar.compile(captured, "dp=2 ep=2").estimate().memory
    experts = sum(captured.graph_module.get_parameter(n).numel() for n in EXPERTS)
    assert dense["params"] - split["params"] == 4 * experts / 2
    assert dense["optimizer"] - split["optimizer"] == 8 * experts / 2


def test_bad_plans_are_refused_naming_the_field_and_a_fix(mixtral):
    model, inputs, captured = mixtral
    with pytest.raises(PlanError, match=r"ep=2 with dp=1: .*ep must divide dp. Fix: dp=2 ep=2, or ep=1"):
        fxpar.Plan.parse("ep=2")
    with pytest.raises(PlanError, match=r"compile=inductor with ep=2 dispatch=alltoall: the rows each rank "
                                        r"receives are sized by the router.*Fix: compile=eager, or "
                                        r"dispatch=allgather \(every shape static\), or ep=1"):
        fxpar.Plan.parse("dp=2 ep=2 compile=inductor")
    fxpar.Plan.parse("dp=2 ep=2 dispatch=allgather compile=inductor")  # every shape static: compiled
    with pytest.raises(PlanError, match=r"dispatch=allgather says how expert parallelism moves tokens.*ep=1. "
                                        r"Fix: add ep=2"):
        fxpar.Plan.parse("dp=2 dispatch=allgather")
    # four experts do not split over eight ranks: the message names the layer
    with pytest.raises(PlanError, match=r"'model.model.layers.0.mlp.experts' has 4 experts, which do not split "
                                        r"over 8 ranks. Fix: ep dividing 4 \(for example ep=4\), or ep=1"):
        fxpar.compile(captured, "dp=8 ep=8")


def test_a_model_without_experts_is_refused():
    model, inputs = build("llama")
    with pytest.raises(PlanError, match=r"ep=2 splits the experts.*this model has none.*Fix: ep=1"):
        fxpar.compile(model, "dp=2 ep=2", inputs)


class _MeanSquares(torch.nn.Module):
    """A loss that is a mean over the outputs, not a sum over valid targets."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model.model(input_ids=input_ids).last_hidden_state.pow(2).mean()


def test_a_loss_that_is_not_a_sum_over_targets_is_refused(mixtral):
    model, inputs, _ = mixtral
    with pytest.raises(PlanError, match=r"ep=2 needs the loss as a sum over the step's valid targets"):
        fxpar.compile(_MeanSquares(model.model), "dp=2 ep=2", inputs)
