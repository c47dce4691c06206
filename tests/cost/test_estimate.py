"""Tier 2/4: Estimate's numbers, formulas, report, errors, and a 1024-rank plan on meta."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.cost.collectives import collective_time
from fxpar.cost.estimate import graph_compute, mfu
from fxpar.cost.hardware import PROFILES
from fxpar.cost.layout import shares
from fxpar.cost.ops import cost_of, op_counts
from fxpar.frontend.trace import capture
from fxpar.ir import meta
from fxpar.ir.symbols import BATCH, SEQ

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    return fxpar.compile(GPT(CONFIG), "dp=2 bucket_mb=0.1", example_inputs=(tokens, tokens))


def test_numbers_are_the_formulas_at_the_example_sizes(program):
    estimate = program.estimate("h100")
    assert estimate.sizes == {"batch": 8, "seq": 32}
    for group in ("flops", "memory", "time"):
        for key, value in getattr(estimate, group).items():
            formula = estimate.formulas[f"{group}.{key}"]
            assert float(formula.subs({BATCH: 8, SEQ: 32})) == pytest.approx(value, rel=1e-3)
    assert estimate.flops["total"] == estimate.flops["matmul"] + estimate.flops["other"]
    assert estimate.uncosted == {}


def test_total_memory_is_the_peak_with_gradient_buckets(program):
    """Under dp=2 the gradients live in bucket buffers all step, so the peak (start of
    backward) holds every term. (The total used to be the sum of params, grads, optimizer and
    activations; it is now the peak, which adds backward's workspace.)"""
    memory = program.estimate("h100").memory
    assert memory["total"] == pytest.approx(
        sum(memory[k] for k in ("params", "grads", "optimizer", "activations", "workspace"))
    )


def test_total_memory_without_buckets_is_the_larger_end_of_backward():
    """dp=1 frees gradients between steps: the peak is at the start of backward (activations
    and workspace, no gradient) or at its end (every gradient, no activation)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    program = fxpar.compile(GPT(CONFIG), "dp=1", example_inputs=(tokens, tokens))
    for batch, seq in [(8, 32), (1, 1)]:
        m = program.estimate("h100", batch=batch, seq=seq).memory
        assert m["total"] == pytest.approx(
            m["params"] + m["optimizer"] + max(m["activations"] + m["workspace"], m["grads"])
        )
    tiny = program.estimate("h100", batch=1, seq=1).memory  # here the gradients are the peak
    assert tiny["total"] == pytest.approx(tiny["params"] + tiny["grads"] + tiny["optimizer"])


def test_zero2_whole_gradients_come_bucket_by_bucket_in_backward_and_stay_with_several():
    """ZeRO-2's reduced shards live all step; its whole gradients (4P fp32) exist from a
    bucket's first gradient to the wait for its reduction (`runtime.state.gradient_buckets`):
    with one microbatch its first bucket comes while every activation is saved and all are
    held when backward ends; several microbatches' are kept through the later forwards."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    model = GPT(CONFIG)
    whole = 4 * sum(p.numel() for p in model.parameters())  # (the tied head once)
    for plan, batch, seq in [("dp=2 zero=2", 8, 32), ("dp=2 zero=2 bucket_mb=0.02", 8, 32),
                             ("dp=2 zero=2", 2, 1), ("dp=2 zero=2 mb=2", 8, 32)]:
        program = fxpar.compile(model, plan, example_inputs=(tokens, tokens))
        m = program.estimate("h100", batch=batch, seq=seq).memory
        held = m["params"] + m["optimizer"] + m["grads"]
        bucket = max(b.nbytes for b in program.buckets)
        if "mb=2" in plan:
            assert m["total"] == pytest.approx(held + whole + m["activations"] + m["workspace"])
        else:
            assert m["total"] == pytest.approx(held + max(m["activations"] + m["workspace"] + bucket, whole))
            assert (bucket < whole) == ("bucket_mb" in plan)
    assert m["grads"] == pytest.approx(whole / 2)  # the shard


def test_workspace_is_twice_the_local_logits(program):
    """W = the logits' gradient and the log-softmax gradient, for one rank's microbatch."""
    estimate = program.estimate("h100")
    local_batch, seq = 8 // 2, 32
    assert estimate.memory["workspace"] == 2 * local_batch * seq * CONFIG.vocab_size * 4
    assert sympy.expand(estimate.formulas["memory.workspace"] - 1024 * BATCH * SEQ) == 0


def test_adam_keeps_a_step_counter_per_tensor(program):
    """torch's Adam/AdamW hold a 4-byte `step` tensor per parameter tensor besides m and v."""
    P, tensors = program.captured.parameter_count(), len(program.captured.parameters)
    assert program.estimate("h100").memory["optimizer"] == 8 * P + 4 * tensors
    assert program.estimate("h100", optimizer="sgd-momentum").memory["optimizer"] == 4 * P
    assert program.estimate("h100", optimizer="sgd").memory["optimizer"] == 0


def test_other_sizes_can_be_asked_for(program):
    small, large = program.estimate("h100"), program.estimate("h100", batch=32, seq=64)
    assert large.sizes == {"batch": 32, "seq": 64}
    assert large.flops["matmul"] > 4 * small.flops["matmul"]  # 4x tokens, longer attention
    assert large.memory["params"] == small.memory["params"]


def test_comm_is_the_programs_collectives(program):
    estimate = program.estimate("h100")
    calls = program.collectives(0)
    assert estimate.comm["all_reduce"]["count"] == len(calls)
    assert estimate.comm["all_reduce"]["payload_bytes"] == sum(c.payload_bytes for c in calls)
    assert estimate.comm["all_reduce"]["wire_bytes"] == sum(c.payload_bytes for c in calls)  # n=2


def test_table_shows_numbers_and_formulas(program):
    table = program.estimate("h100").table()
    assert "plan 'dp=2 bucket_mb=0.1' on h100" in table
    assert "flops.matmul" in table and "batch*seq" in table
    assert "memory.activations" in table and "comm.all_reduce" in table
    assert "memory.workspace" in table and "memory.total (peak)" in table
    assert "uncosted ops          none" in table


def test_unknown_hardware_lists_the_profiles(program):
    with pytest.raises(ValueError, match="unknown hardware 'tpu'; known profiles: cpu, a100, h100, h200"):
        program.estimate("tpu")


def test_mfu_convention():
    # 6 * 124M params * 16 * 1024 tokens in 0.1 s on one 989 TFLOP/s device.
    assert mfu(6 * 124e6 * 16 * 1024, 0.1, 1, 989e12) == pytest.approx(0.1233, rel=1e-3)


class _Cumulative(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, y):
        return F.mse_loss(torch.cumsum(self.proj(x), dim=1), y)


def test_an_op_without_a_rule_is_costed_by_bytes_and_named():
    x = torch.randn(4, 8)
    program = fxpar.compile(_Cumulative(), "dp=1", example_inputs=(x, x))
    estimate = program.estimate("h100")
    assert estimate.uncosted == {"aten.cumsum.default": 1}
    assert "aten.cumsum.default x1" in estimate.table()
    captured = capture(_Cumulative(), (x, x))
    node = next(n for n in captured.graph_module.graph.nodes if "cumsum" in str(n.target))
    cost = cost_of(node, captured.shape)
    assert not cost.costed and cost.bytes == 2 * BATCH * 8 * 4  # read and write (batch, 8) fp32


def test_linear_and_attention_rules():
    torch.manual_seed(0)
    captured = capture(GPT(CONFIG), (torch.randint(0, 256, (4, 16)),) * 2)
    nodes = list(captured.graph_module.graph.nodes)
    q = next(n for n in nodes if str(n.target) == "aten.linear.default")
    sdpa = next(n for n in nodes if "scaled_dot_product" in str(n.target))
    assert cost_of(q, captured.shape).matmul_flops == 2 * BATCH * SEQ * 64 * 64
    assert cost_of(q, captured.shape).other_flops == BATCH * SEQ * 64  # the bias add
    assert cost_of(q, captured.shape).attention_flops == 0
    attention = cost_of(sdpa, captured.shape)
    assert sympy.expand(attention.matmul_flops - 4 * BATCH * SEQ**2 * 64) == 0
    assert attention.attention_flops == attention.matmul_flops  # counted in both (MFU needs it)


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.relu(self.a(x))), y)


def test_op_counts():
    """Forward: linear, relu, linear, mse_loss (broadcast_tensors returns a tuple, not counted).
    Backward: the same four, each needing a gradient, plus 3 AccumulateGrad (a.weight,
    a.bias, b.weight)."""
    x = torch.randn(4, 8)
    program = fxpar.compile(_TwoLayers(), "dp=1", example_inputs=(x, x.clone()))
    assert op_counts(program.captured.graph_module) == (4, 7)


def test_compute_time_is_rates_bytes_and_overhead(program):
    """time.compute = 3 x (dense matmul / matmul rate + attention / attention rate + other
    bytes / their bandwidth) / dp + op_overhead x (forward ops + backward nodes)."""
    device = replace(PROFILES["h100"], attention_efficiency=0.25, elementwise_efficiency=0.5,
                     op_overhead=7e-6)
    estimate = program.estimate(device)
    c = graph_compute(program)
    rate = device.matmul_rate("fp32")
    # The overhead counts the ops the rank runs: the compiled graph's (its loss divides the sum
    # by the global count of valid targets: one op more, forward and backward, than captured).
    forward_ops, backward_nodes = op_counts(program.graph_module)
    assert (forward_ops, backward_nodes) == (c.forward_ops + 1, c.backward_nodes + 1)
    expected = sympy.Rational(3, 2) * (
        (c.matmul_flops - c.attention_flops) / rate + c.attention_flops / (0.25 * rate)
        + c.other_bytes / (0.5 * device.memory_bandwidth)
    ) + 7e-6 * (forward_ops + backward_nodes)
    assert estimate.time["compute"] == pytest.approx(float(expected.subs({BATCH: 8, SEQ: 32})))
    assert c.attention_flops != 0 and c.forward_ops > 0 and c.backward_nodes > c.forward_ops / 2
    slower = program.estimate(replace(device, attention_efficiency=0.125)).time["compute"]
    attention_seconds = float((3 * c.attention_flops / 2 / (0.25 * rate)).subs({BATCH: 8, SEQ: 32}))
    assert slower - estimate.time["compute"] == pytest.approx(attention_seconds)


def test_optimizer_time_is_per_tensor_plus_bytes(program):
    device = replace(PROFILES["h100"], optimizer_tensor_overhead=20e-6, op_overhead=3e-6)
    P, tensors = program.captured.parameter_count(), len(program.captured.parameters)
    bandwidth = device.memory_bandwidth
    assert program.estimate(device).time["optimizer"] == pytest.approx(
        tensors * 20e-6 + 58 * P / bandwidth)
    assert program.estimate(device, optimizer="sgd").time["optimizer"] == pytest.approx(
        tensors * 1 * 3e-6 + 12 * P / bandwidth)


def test_comm_overlap_zero_exposes_every_collective(program):
    """With comm_overlap 0 (the CPU: gloo shares the cores) nothing hides under backward."""
    hidden, exposed = (program.estimate(replace(PROFILES["h100"], comm_overlap=f))
                       for f in (1.0, 0.0))
    link = PROFILES["h100"].intra_node
    alone = sum(float(collective_time(c.kind, c.payload_bytes, len(c.group), link))
                for c in program.collectives(0))
    assert exposed.time["comm_exposed"] == pytest.approx(alone)
    assert hidden.time["comm_exposed"] < alone


def test_tensor_parallel_calls_are_exposed_where_the_runtime_waits_for_them():
    """The op after Megatron's f or g reads what the call returns, so tp's calls hide under no
    compute, however much the profile overlaps (h100: dp's buckets hide under backward); under
    compile=inductor a backward one is waited for after the weight gradients, and may hide."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    device = PROFILES["h100"]
    for plan in ("tp=2", "dp=2 tp=2 sp=true"):
        eager, compiled = (fxpar.compile(GPT(CONFIG), f"{plan}{mode}", example_inputs=(tokens, tokens))
                           for mode in ("", " compile=inductor"))
        tp = [c for c in eager.collectives(0) if c.tag.startswith("tp ") or "on tp" in c.tag]
        blocking = sum(float(collective_time(c.kind, c.payload_bytes, len(c.group), device.intra_node)) for c in tp)
        assert tp and eager.estimate(device).time["comm_exposed"] >= blocking * (1 - 1e-9)
        forward = sum(float(collective_time(c.kind, c.payload_bytes, len(c.group), device.intra_node))
                      for c in tp if c.phase == "forward")
        assert forward * (1 - 1e-9) <= compiled.estimate(device).time["comm_exposed"] < blocking


def test_a_1024_rank_plan_of_a_meta_model_is_estimated():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=12288, n_head=96, vocab_size=51200, block_size=2048))
    tokens = torch.randint(0, 51200, (1024, 2048))
    program = fxpar.compile(model, "dp=1024 zero=3 precision=bf16-mixed reduce_dtype=bf16",
                            example_inputs=(tokens, tokens))
    estimate = program.estimate("h100")
    P = program.captured.parameter_count()
    # 16P/N (ZeRO-3, gradients reduced in bf16 as the paper's), plus Adam's 4-byte step
    # counter for each parameter's piece the rank updates.
    assert estimate.memory["params"] + estimate.memory["grads"] + estimate.memory["optimizer"] == (
        pytest.approx(16 * P / 1024 + 4 * len(program.captured.parameters), rel=1e-12)
    )
    units = meta.graph_parameter_units(program.graph_module)  # one gather per layer, and
    # again for backward, all but the root's layer (kept whole for the head's backward)
    assert estimate.comm["all_gather"]["count"] == 2 * len(units) - 1 == 5
    assert estimate.time["total"] > estimate.time["compute"] > 0
    assert 0 < estimate.mfu() < 1


# -- the zero-bubble schedule: each backward split into B and W -------------------------------------

# Large enough that matmuls, not per-op overheads, set the stage times; on meta, nothing allocated.
MEDIUM = GPTConfig(n_layer=4, n_embd=1024, n_head=16, vocab_size=4096, block_size=512)


@pytest.fixture(scope="module")
def zb_and_1f1b():
    with torch.device("meta"):
        model = GPT(MEDIUM)
    tokens = torch.randint(0, MEDIUM.vocab_size, (16, 512))
    return {name: fxpar.compile(model, f"pp=2 mb=4 schedule={name}", example_inputs=(tokens, tokens))
            for name in ("zb-h1", "1f1b")}


def seconds_by_stage_and_kind(simulation) -> dict[tuple[int, str], float]:
    seconds: dict[tuple[int, str], float] = {}
    for row in simulation.timeline:
        for action, start, end in row:
            key = (action.stage, action.kind)
            seconds[key] = seconds.get(key, 0.0) + end - start
    return seconds


def test_zb_h1_shrinks_the_bubble_and_keeps_the_backward(zb_and_1f1b):
    """ZB-H1 runs the weight gradients (W) in what 1F1B leaves idle (Qi et al. 2024, Sec. 3.1):
    a smaller bubble on every rank, for the same work. B + W of each stage is 1F1B's B, to
    float rounding (the split is one subtraction)."""
    zb, whole = (zb_and_1f1b[name].estimate("h100") for name in ("zb-h1", "1f1b"))
    assert zb.pipeline.schedule.splits_backward and not whole.pipeline.schedule.splits_backward
    assert zb.time["bubble"] < whole.time["bubble"]
    for rank in range(2):
        assert zb.pipeline.total - zb.pipeline.busy[rank] < whole.pipeline.total - whole.pipeline.busy[rank]
    split, one = seconds_by_stage_and_kind(zb.pipeline), seconds_by_stage_and_kind(whole.pipeline)
    for stage in range(2):
        assert split[stage, "F"] == pytest.approx(one[stage, "F"], rel=1e-12)
        assert 0 < split[stage, "W"] < split[stage, "B"]
        assert split[stage, "B"] + split[stage, "W"] == pytest.approx(one[stage, "B"], rel=1e-12)


def test_weight_gradient_is_the_linears_weights_times_two_tokens(zb_and_1f1b):
    """W of a linear is grad_out^T x: 2 x tokens x in x out FLOPs. This GPT's linears hold
    12 d^2 weights per layer (q, k, v, o: 4 d^2; the MLP: 8 d^2) and the tied head V d, so the
    stages' W FLOPs sum to 2 batch seq (12 L d^2 + V d); at the matmul rate, the W seconds of
    the simulated step (dp=1: one rank does a stage's whole batch)."""
    program = zb_and_1f1b["zb-h1"]
    L, d, V = MEDIUM.n_layer, MEDIUM.n_embd, MEDIUM.vocab_size
    closed_form = 2 * BATCH * SEQ * (12 * L * d**2 + V * d)
    assert sympy.expand(sum(s.weight_gradient_flops for s in shares(program)) - closed_form) == 0
    estimate = program.estimate("h100")
    w_seconds = sum(t for (_, kind), t in seconds_by_stage_and_kind(estimate.pipeline).items() if kind == "W")
    rate = PROFILES["h100"].matmul_rate("fp32")
    assert w_seconds == pytest.approx(float(closed_form.subs({BATCH: 16, SEQ: 512})) / rate, rel=1e-9)


def test_a_weight_tied_to_an_embedding_in_the_same_graph_stays_in_b(program):
    """Unpipelined, the tied wte is read by the embedding and the head in one graph: its
    gradient is not deferred (`passes.weight_gradients`), so W holds only the blocks' 12 L d^2."""
    (whole,) = shares(program)
    L, d = CONFIG.n_layer, CONFIG.n_embd
    assert sympy.expand(whole.weight_gradient_flops - 2 * BATCH * SEQ * 12 * L * d**2) == 0


def test_tensor_parallel_stages_split_their_weight_gradients():
    """Under tp=2 every linear of the GPT is column- or row-parallel (the head vocab-parallel),
    so each rank computes half of each weight gradient; the program compiles and checks."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    flops = {}
    for plan in ("pp=2 mb=2 schedule=zb-h1", "pp=2 tp=2 mb=2 schedule=zb-h1"):
        program = fxpar.compile(GPT(CONFIG), plan, example_inputs=(tokens, tokens))
        program.check()
        flops[plan] = sum(s.weight_gradient_flops for s in shares(program))
        assert program.estimate("h100").pipeline.schedule.name == "zb-h1"
    assert sympy.expand(2 * flops["pp=2 tp=2 mb=2 schedule=zb-h1"] - flops["pp=2 mb=2 schedule=zb-h1"]) == 0


def test_no_pipeline_no_simulation(program):
    assert program.estimate("h100").pipeline is None


def test_plans_of_one_capture_are_estimated_as_from_their_own_capture():
    """Rank modules alike across plans share one activation trace per capture
    (`cost.memo.module_key`): each estimate equals the one made from a fresh capture."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, 256, (8, 32))
    shared = capture(model, (tokens, tokens))
    for plan in ("dp=2", "dp=4 zero=1", "tp=2 pp=2 sp=true mb=2", "dp=2 checkpoint=selective"):
        once = fxpar.compile(shared, plan).estimate("h100")
        alone = fxpar.compile(capture(model, (tokens, tokens)), plan).estimate("h100")
        assert (once.memory, once.time) == (alone.memory, alone.time), plan


def test_bf16_mixed_elementwise_time_reads_the_bytes_of_the_dtypes_it_computes_in():
    """The rank graph's values carry bf16-mixed's dtypes (bf16 ops, the fp32 loss and the cast
    to it), so its bytes are priced as they are: not halved again (they once were: the loss's
    fp32 log-softmax over the logits was priced at bf16's half)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 32))
    only_bytes = replace(PROFILES["h100"], peak_flops={"fp32": 1e30, "bf16": 1e30}, op_overhead=0.0)
    times = {}
    for precision in ("fp32", "bf16-mixed"):
        program = fxpar.compile(GPT(CONFIG), f"dp=1 precision={precision}", example_inputs=(tokens, tokens))
        (share,) = shares(program)
        sizes = {BATCH: 8, SEQ: 32}
        moved = float(share.other_bytes.subs(sizes))
        times[precision] = program.estimate(only_bytes).time["compute"]
        assert times[precision] == pytest.approx(3 * moved / only_bytes.elementwise_bandwidth(), rel=1e-6)
    assert 0.5 < times["bf16-mixed"] / times["fp32"] < 1  # bf16 ops, but an fp32 loss and its cast
