"""`runtime.compiled_forward` in one process: a second runner of the same program compiles
from Inductor's on-disk caches, as a restarted job does; what Inductor cannot compile is a
PlanError that names the node and its module path, with compile=eager as the fix; a
zero-bubble stage is compiled between its deferred linears and leaves their weight gradients
for W; the plan refuses what compiled mode does not cover; verify refuses a compiled plan (it
records eager values)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters

import fxpar
from fxpar.errors import PlanError, VerifyError
from fxpar.frontend.trace import capture
from fxpar.ops import deferred_linear
from fxpar.passes.weight_gradients import defer_weight_gradients
from fxpar.plan.plan import Plan
from fxpar.runtime.compiled_forward import CompiledForward
from fxpar.cost.compiled_pieces import compiled_calls
from fxpar.runtime.step.weight_gradients import WeightGradientStore
from fxpar.runtime.step.valid_targets import CountArrival

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def test_a_restarted_job_compiles_from_inductors_caches(torchrun_world_of_one, monkeypatch, tmp_path):
    """The second runner starts with Dynamo's in-memory state reset, as a new process does, and
    finds every graph in the (fresh, per-test) cache folder the first one filled: the compiled
    forward and backward (Inductor's FX graph cache) and their partition (AOTAutograd's)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (4, 16))
    hits = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        runner = fxpar.compile(model, "dp=1 compile=inductor", (tokens, tokens.clone())).bind(timeout=30)
        try:
            runner.step(tokens, tokens.clone())
        finally:
            runner.close()
        hits.append((counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"]))
    assert hits == [(0, 0), (2, 1)]  # forward and backward graphs; one partition


def _storage_address(x: torch.Tensor) -> torch.Tensor:
    """Python Dynamo cannot trace (what a recomputed region's meter once called)."""
    return x + x.untyped_storage().data_ptr() % 2


def test_a_graph_inductor_cannot_compile_names_the_node_and_module():
    graph = fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    odd = graph.call_function(_storage_address, (doubled,))
    odd.meta["nn_module_stack"] = {"h.1.mlp": ("h.1.mlp", torch.nn.Module)}
    graph.output(odd)
    forward = fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(PlanError) as caught:
        CompiledForward(forward, arrival=CountArrival(), name="module 0", gathers_ahead=1)(torch.ones(3))
    message = str(caught.value)
    assert re.search(r"module 0 at node '_storage_address' .* in module 'h\.1\.mlp': .*data_ptr", message), message
    assert message.endswith("Fix: compile=eager, which runs the same graph op by op")
    assert (caught.value.field, caught.value.value) == ("compile", "inductor")


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        hidden = self.up(self.norm(2 * x + 1))
        return (x + self.down(torch.nn.functional.gelu(hidden))).square().sum()


def test_a_zero_bubble_stage_compiles_between_its_deferred_linears_and_leaves_w_for_later():
    """The stage of `schedule=zb-h1 compile=inductor` (`runtime.compiled_segments`): the
    stretches with something to fuse (2x + 1 and the layer norm; the residual add, square and
    sum) compiled, the two deferred linears run op by op with the GELU between them, alone in
    its stretch; B leaves the linears' weight gradients in the store, and W gives the
    gradients one eager backward gives (fp32, each gradient's norm relative 1e-6: Inductor's
    fused layer norm sums in another order than ATen's kernel)."""
    torch.manual_seed(0)
    stage = defer_weight_gradients(capture(_Block(), (torch.randn(4, 8),)).graph_module)
    x = torch.randn(4, 8)

    def gradients(forward, weights_apart: set[str]):
        stage.zero_grad(set_to_none=True)
        store = WeightGradientStore()
        with store.collect((0, 0)):
            forward(x, store).backward()
        assert {n for n, p in stage.named_parameters() if p.grad is None} == weights_apart  # B
        store.run((0, 0))  # W
        return {n: p.grad.clone() for n, p in stage.named_parameters()}

    eager = gradients(stage, {"up.weight", "down.weight"})
    compiled = CompiledForward(stage, arrival=CountArrival(), name="module 0", gathers_ahead=1)
    pieces = list(compiled.compiled.children())
    kinds = ["compiled" if isinstance(p, torch._dynamo.eval_frame.OptimizedModule) else "eager"
             for p in pieces if isinstance(p, (fx.GraphModule, torch._dynamo.eval_frame.OptimizedModule))]
    assert kinds == ["compiled", "eager", "compiled"]
    between = [n.target for p in pieces if isinstance(p, fx.GraphModule) for n in p.graph.nodes if n.op == "call_function"]
    assert between == [deferred_linear.linear, torch.ops.aten.gelu.default, deferred_linear.linear]
    assert compiled_calls(stage) == (2, 3)  # what the estimate prices (`cost.step_time`)
    found = gradients(compiled, {"up.weight", "down.weight"})
    for name, grad in eager.items():
        assert (found[name] - grad).norm() <= 1e-6 * grad.norm(), name  # (measured 2e-7 at most)


@pytest.mark.parametrize(("text", "refused", "fix"), [
    ("dp=2 zero=3 prefetch=2 compile=inductor", "prefetch=2", "prefetch=1"),
    ("dp=2 zero=3 mb=2 zero_reduce=step compile=inductor", "zero=3 zero_reduce=step", "drop zero_reduce"),
])
def test_what_compiled_mode_does_not_cover_is_refused_with_a_fix(text, refused, fix):
    with pytest.raises(PlanError, match=rf"compile=inductor with {refused}: .* Fix: {fix}"):
        Plan.parse(text)


def test_compiled_zero3_gathers_where_layers_read_and_reduces_per_microbatch():
    """ZeRO-3's `prefetch` defaults to FSDP2's 1 layer ahead, in eager mode and in a compiled
    graph (`runtime.collective_schedule`; 0 gathers where a layer reads), and a compiled
    backward reduce-scatters each microbatch's gradients (`fxpar.plan.zero_reduction`)."""
    assert Plan.parse("dp=2 zero=3").gathers_ahead == 1
    assert Plan.parse("dp=2 zero=3 prefetch=3").gathers_ahead == 3
    assert Plan.parse("dp=2 zero=3 compile=inductor").gathers_ahead == 1
    assert Plan.parse("dp=2 zero=3 prefetch=0 compile=inductor").gathers_ahead == 0
    assert str(Plan.parse("dp=2 zero=3 compile=inductor")) == "dp=2 zero=3 compile=inductor"
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (4, 16))
    program = fxpar.compile(model, "dp=2 zero=3 mb=2 compile=inductor", (tokens, tokens.clone()))
    assert program.zero_reduce.per_microbatch


def test_verify_refuses_a_compiled_plan():
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    tokens = torch.randint(0, 64, (4, 16))
    with pytest.raises(VerifyError, match="Fix: verify the plan with compile=eager"):
        fxpar.verify(model, "dp=2 compile=inductor", (tokens, tokens.clone()))
