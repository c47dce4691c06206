"""Tier 1: bf16-mixed as a graph rewrite (`passes.mixed_precision`): what each value is
computed in, read off the compiled graph, and the buckets and collectives that follow."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar import PlanError
import fxpar
from fxpar.ir import meta
from fxpar.passes.contracts import ContractError
from fxpar.passes.mixed_precision import cast_to_bf16, computes_in_bf16
from fxpar.runtime.state.master_weights import MasterWeights

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402

aten = torch.ops.aten


class _Mixed(nn.Module):
    """A float input times an fp32 buffer (both kept fp32, as autocast keeps them), and an fp32
    value the model itself makes (a factory op) that promotes the bf16 activations back to
    fp32 right before a matmul."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x, y):
        h = self.up(x * self.scale)
        h = h + torch.zeros(8)  # fp32 by default: h is fp32 again
        return F.cross_entropy(self.head(h), y)


def _casts(gm: torch.fx.GraphModule) -> list[tuple[str, torch.dtype]]:
    """(what is cast, to which dtype) for every cast the graph holds, in graph order."""
    return [(n.args[0].name, n.kwargs["dtype"]) for n in gm.graph.nodes if n.target is aten._to_copy.default]


def test_gpt_stores_trained_weights_in_bf16_and_computes_its_loss_in_fp32():
    tokens, labels = global_batches()[0]
    program = fxpar.compile(build_model(), "precision=bf16-mixed", example_inputs=(tokens, labels))
    assert "cast_to_bf16" in str(program.passes)
    gm = program.graph_module
    for name, node in meta.parameter_nodes(gm.graph).items():
        assert (node.meta["val"].dtype, meta.master_dtype(node)) == (torch.bfloat16, torch.float32), name
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert linears and all(n.meta["val"].dtype == torch.bfloat16 for n in linears)
    # One cast in the whole graph: the logits, to fp32, for the cross entropy.
    (cast,) = [n for n in gm.graph.nodes if n.target is aten._to_copy.default]
    assert cast.kwargs["dtype"] == torch.float32 and list(cast.users)[0].target is aten.cross_entropy_loss.default
    assert "_to_copy.default(view_8, dtype = torch.float32)" in program.rank_module(0).code
    assert gm.graph.output_node().args[0].meta["val"].dtype == torch.float32
    computes_in_bf16(gm)


def test_inputs_buffers_and_the_models_own_fp32_values_reach_matmuls_in_bf16():
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    torch.manual_seed(0)
    model = _Mixed()
    program = fxpar.compile(model, "precision=bf16-mixed", example_inputs=(x, y))
    gm = program.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["x"].meta["val"].dtype == nodes["scale"].meta["val"].dtype == torch.float32
    up, head = (next(n for n in gm.graph.nodes if n.target is aten.linear.default and path in meta.module_path(n))
                for path in ("up", "head"))
    for linear in (up, head):  # x * scale, and the fp32 sum: cast to bf16 for the matmul
        cast = linear.args[0]
        assert cast.target is aten._to_copy.default and cast.kwargs["dtype"] == torch.bfloat16
        assert cast.args[0].meta["val"].dtype == torch.float32
        assert linear.meta["val"].dtype == torch.bfloat16
    assert [dtype for _, dtype in _casts(gm)] == [torch.bfloat16, torch.bfloat16, torch.float32]  # + the loss's
    computes_in_bf16(gm)
    # It runs: bf16 working weights (the runtime's, from their fp32 masters), an fp32 loss
    # within bf16's rounding (2^-9 per rounding, a few of them) of the fp32 model's.
    module = program.rank_module(0)
    masters = MasterWeights.keep([module])
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert {t.dtype for t in masters.tensors()} == {torch.float32} and len(masters.tensors()) == 4
    loss = module(x, y, torch.tensor(4.0)) if "valid_targets" in module.code else module(x, y)
    assert loss.dtype == torch.float32
    with torch.no_grad():
        expected = _Mixed()
        expected.load_state_dict({k: v.float() for k, v in masters.full_precision(module.state_dict(keep_vars=True)).items()})
        assert loss.item() == pytest.approx(expected(x, y).item(), rel=2e-2)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hugging_face_models_run_in_bf16(name):
    """GPT-2's fp32 attention mask promotes its residual stream to fp32 before a LayerNorm with
    bf16 weights (which torch's CPU kernel refuses: the norm reads a bf16 copy); Llama keeps
    its rotary `inv_freq` in fp32 and upcasts in RMSNorm (export's `_assert_tensor_metadata`
    checks follow the new dtypes); Mixtral's experts run transformers' own grouped_mm, which
    has no type promotion, on the tokens cast to its weights' dtype as captured (fp32): it
    reads a bf16 copy (it compiled, then failed in its first step, before). The rank module
    runs on bf16 working weights, and its fp32 loss is the fp32 model's to within bf16's
    rounding."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from hf_models import build

    torch.manual_seed(0)
    model, inputs = build(name)
    with torch.no_grad():
        expected = model(*inputs).item()
    program = fxpar.compile(model, "precision=bf16-mixed", example_inputs=inputs)
    computes_in_bf16(program.graph_module)
    module = program.rank_module(0)
    MasterWeights.keep([module])
    count = (inputs[1][:, 1:] != -100).sum().float()  # the causal loss's shifted targets
    with torch.no_grad():
        loss = module(*inputs, count)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=1e-2)


class _Dot(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("w", torch.ones(8))

    def forward(self, x):
        return self.lin(x).mean(0).dot(self.w)  # bf16 . fp32: torch.dot refuses mixed dtypes


def test_an_op_that_refuses_mixed_dtypes_is_a_plan_error_naming_it():
    with pytest.raises(PlanError, match=r"precision=bf16-mixed: .*dot.*bfloat16, float32.*Fix:") as error:
        fxpar.compile(_Dot(), "precision=bf16-mixed", example_inputs=(torch.randn(4, 8),))
    assert error.value.field == "precision"


def test_the_contract_catches_an_fp32_matmul():
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    program = fxpar.compile(_Mixed(), "dp=1", example_inputs=(x, y))  # fp32: no pass
    with pytest.raises(ContractError):
        computes_in_bf16(program.graph_module)
    computes_in_bf16(cast_to_bf16(program.graph_module))


@pytest.mark.parametrize("reduce_dtype, wire", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_gradients_are_bf16_and_reduced_in_the_plans_reduce_dtype(reduce_dtype, wire):
    tokens, labels = global_batches()[0]
    plan = f"dp=2 zero=2 precision=bf16-mixed reduce_dtype={reduce_dtype}"
    program = fxpar.compile(build_model(), plan, example_inputs=(tokens, labels))
    program.check()  # bind runs bf16-mixed: nothing refused
    assert {(b.dtype, b.reduced_dtype) for b in program.buckets} == {(torch.bfloat16, wire)}
    calls = program.collectives(0)
    assert {c.dtype for c in calls if c.tag.startswith("gradient bucket")} == {wire}
    assert {c.dtype for c in calls if c.tag.startswith("updated parameters")} == {torch.bfloat16}
    assert [c.dtype for c in calls if c.tag == "loss"] == [torch.float32]  # the loss alone, in fp32


def test_zero3_gathers_in_bf16_and_reduce_scatters_in_the_reduce_dtype():
    """ZeRO-3 under bf16-mixed (`passes.zero3`): with reduce_dtype=fp32 (the default) each
    piece is its fp32 master (no `fxpar.master_dtype`), its gather casts it to bf16 and the
    layer computes in bf16, and the gather's backward reduce-scatters in fp32; with bf16 the
    pieces are bf16 working copies and both collectives run in bf16. The step program's calls
    (what the check, the estimate and `comm_stats` read) say so."""
    tokens, labels = global_batches()[0]
    gather, regather = torch.ops.fxpar.gather_parameters.default, torch.ops.fxpar.regather_parameters.default
    expected = {
        "fp32": ({"dp gather_parameters": torch.bfloat16, "dp regather_parameters (backward)": torch.bfloat16,
                  "dp gather_parameters (backward)": torch.float32}, torch.float32, None),
        "bf16": ({"dp gather_parameters": torch.bfloat16, "dp regather_parameters (backward)": torch.bfloat16,
                  "dp gather_parameters (backward)": torch.bfloat16}, torch.bfloat16, torch.float32),
    }
    for reduce_dtype, (wire, pieces, master) in expected.items():
        program = fxpar.compile(build_model(), f"dp=2 zero=3 precision=bf16-mixed reduce_dtype={reduce_dtype}",
                                example_inputs=(tokens, labels))
        program.check()
        calls = {c.tag: c.dtype for c in program.collectives(0) if c.kind in ("all_gather", "reduce_scatter")}
        assert calls == wire, reduce_dtype
        graph = program.rank_module(0).graph
        gathers = [n for n in graph.nodes if n.target is gather]
        # every layer gathered again for backward but the root's (`passes.zero3`)
        assert gathers and len([n for n in graph.nodes if n.target is regather]) == len(gathers) - 1
        for node in gathers:
            assert {s.meta["val"].dtype for s in node.args[0]} == {pieces}
            assert {meta.master_dtype(s) for s in node.args[0]} == {master}
            assert {v.dtype for v in node.meta["val"]} == {torch.bfloat16}  # what the layer reads


def test_ddp_buckets_carry_the_loss_only_in_fp32():
    tokens, labels = global_batches()[0]
    for plan, carried in (("dp=2", True), ("dp=2 precision=bf16-mixed", False)):
        calls = fxpar.compile(build_model(), plan, example_inputs=(tokens, labels)).collectives(0)
        assert any(" + loss" in c.tag for c in calls) is carried  # (its count and steps may follow)
        assert any(c.tag == "loss" for c in calls) is not carried
