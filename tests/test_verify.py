"""Tier 3: `fxpar.verify` finds the first node where a plan's step differs from one device.

Each verify forks `plan.world_size` gloo ranks (a few seconds each), so the module runs three:
a clean plan over tp, pp and microbatches reports equal; a wrong redistribution rule (the
row-parallel output's all-reduce replaced by f, an identity in forward) is named at the first
node that reads the unreduced value, in forward; and a dropped collective (one f removed from
the graph and its backward all-reduce from every rank's step program, consistently, so the
check passes and nothing hangs, but the gradient is a partial sum) is named at the gradient of
f's input, with dp=2 x tp=2 and ZeRO-3's parameter pieces reassembled on the way. Tolerances: verify's own (fp32, rel 1e-5
of a value's largest magnitude + abs 1e-9, `fxpar.tools.verify_report`); the faults are off by O(1).
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import Partial, Replicate
from fxpar.ops.distributed import distributed_op
from fxpar.ops.redistribution import BY_NAME, Conversion
from fxpar.passes.tensor_parallel import rewrite as tensor_parallel

sys.path.insert(0, str(Path(__file__).parent / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from hf_models import build  # noqa: E402
from step_program_edits import drop_call, resize_call  # noqa: E402
from tiny_training import CONFIG, build_model, global_batches  # noqa: E402  (puts examples/ on the path)
from gpt import GPT  # noqa: E402

pytestmark = pytest.mark.multirank
BATCH = global_batches()[0]


def reference_nodes(program) -> list:
    """The one-device graph verify compares against, in order (the captured graph, its loss as
    a sum over the count)."""
    return list(fxpar.compile(program.captured, "dp=1", check=False).graph_module.graph.nodes)


def test_a_clean_plan_equals_one_device():
    report = fxpar.verify(build_model(), "tp=2 pp=2 mb=2", BATCH, timeout=20)
    assert report.equal, str(report)
    assert str(report).startswith("fxpar verify: plan 'pp=2 tp=2 mb=2' equals one device: ")
    # every node's value (inputs, parameters, computed), the batch-dependent gradients, and each
    # trained parameter's reduced gradient (the tied embedding and head once)
    assert report.compared["forward value"] > 80 and report.compared["gradient"] > 40
    assert report.compared["parameter gradient"] == len(dict(build_model().named_parameters()))
    assert report.loss_parallel == pytest.approx(report.loss_reference, rel=1e-6)


def test_a_plan_whose_count_rides_in_a_bucket_equals_one_device():
    """dp's count of valid targets rides in the first bucket: the ranks' graphs divide by 1 and
    the buckets by the global count (`runtime.step.loss`); the reference is given 1 too, so
    every node compares as it is, and the loss and reduced gradients after the division."""
    program = fxpar.compile(build_model(), "dp=2 mb=2", BATCH)
    assert program.step_program(0).count_slots() == 2
    report = fxpar.verify(program, example_inputs=BATCH, timeout=20)
    assert report.equal, str(report)
    assert report.compared["parameter gradient"] == len(dict(build_model().named_parameters()))
    assert report.loss_parallel == pytest.approx(report.loss_reference, rel=1e-6)


def test_context_parallel_equals_one_device_value_by_value():
    """cp's pieces of a value are joined along its sequence dim (inside tp's); the logits
    flattened to [batch * seq, vocab] are held by each rank as its slice of every row, in no
    order a concatenation gives, and are left out, counted (their loss and gradients are not)."""
    report = fxpar.verify(build_model(), "cp=2 tp=2", BATCH, timeout=20)
    assert report.equal, str(report)
    assert report.left_out == {"values whose sequence cp flattens into another dim": 1}
    assert report.compared["gradient"] > 40
    assert report.compared["parameter gradient"] == len(dict(build_model().named_parameters()))


def test_a_mixture_of_experts_equals_one_device_under_dp_and_ep():
    """Each rank sorts its own tokens by expert, so the values inside the experts module are in
    the rank's order and are left out, counted; what the module gives back, the expert weights
    (joined over ep) and every gradient after are compared."""
    model, inputs = build("mixtral")
    # 8 such values a layer (the all-to-all sends a rank's own picked rows on, under their
    # captured names)
    for plan, left_out in (("dp=2", 16), ("dp=2 ep=2", 16)):
        report = fxpar.verify(model, plan, inputs, timeout=30)
        assert report.equal, str(report)
        assert report.left_out == {"values in the order a rank sorted its tokens (a mixture of experts' dispatch)": left_out}
        assert report.compared["parameter gradient"] == len(dict(model.named_parameters()))


def test_a_wrong_redistribution_rule_is_named_at_the_first_node_reading_the_bad_value(monkeypatch):
    """The tp pass asks the table how to make a row-parallel linear's output (Partial, each
    rank's summand) whole; for the third it asks (h.0's MLP projection), a wrong row gives f
    (copy_to_region: identity in forward) instead of g (all-reduce). The first node that reads
    the unreduced value (the MLP's dropout) is the first that differs; the linear's own value,
    whose summands are right, matches."""
    real = tensor_parallel.redistribution
    faulty = []

    def wrong_row(have, want, into_sharded_math):
        row = real(have, want, into_sharded_math)
        if isinstance(have, Partial) and isinstance(want, Replicate) and not into_sharded_math:
            faulty.append(row)
            if len(faulty) == 3:
                return Conversion(BY_NAME["copy_to_region"])
        return row

    monkeypatch.setattr(tensor_parallel, "redistribution", wrong_row)
    program = fxpar.compile(build_model(), "tp=2", BATCH)
    monkeypatch.undo()
    (wrong,) = [n for n in program.graph_module.graph.nodes
                if distributed_op(n) is not None and distributed_op(n).name == "copy_to_region"
                and isinstance(meta.placement(n.args[0], "tp"), Partial)]
    unreduced = wrong.args[0].name  # the row-parallel linear's output, whose summands are right
    assert meta.module_path(wrong.args[0]) == "h.0.mlp.down"
    consumer = next(n for n in reference_nodes(program) if unreduced in {a.name for a in n.all_input_nodes})
    report = fxpar.verify(program, example_inputs=BATCH, timeout=20, check=False)
    assert not report.equal
    first = report.first
    assert (first.what, first.node, first.module_path) == ("forward value", consumer.name, "h.0.mlp.dropout")
    assert first.reference.shape == first.parallel.shape == (8, 16, 32)
    assert first.max_relative > 0.1  # off by the other rank's summand, not by rounding
    text = str(report)
    assert f"first divergent: forward value of node {consumer.name} (module 'h.0.mlp.dropout')" in text
    assert "one device" in text and "parallel" in text and "max abs difference" in text


def test_a_dropped_collective_is_named_at_the_gradient_it_should_have_summed():
    """f before h.1's attention (copy_to_region of ln_1's output) is removed from the graph and
    its backward all-reduce from every rank's step program alike: the ranks still agree (check
    passes, nothing hangs), forward is unchanged, and ln_1's output gets each tp rank's partial
    gradient. verify names that gradient: backward's first wrong value."""
    # ZeRO-3 too: the parameters, compared first, are put back from FlatShard pieces inside
    # their tp shards
    program = fxpar.compile(build_model(), "dp=2 tp=2 zero=3", BATCH)
    graph = program.graph_module.graph
    (f,) = [n for n in graph.nodes if distributed_op(n) is not None
            and distributed_op(n).name == "copy_to_region" and meta.module_path(n) == "h.1.attn.q"]
    source = f.args[0]
    steps = {r: program.step_program(r) for r in range(program.world_size)}
    calls = steps[0].calls()
    (position,) = [i for i, c in enumerate(calls)
                   if c.tag == "tp copy_to_region (backward)" and c.where == "h.1.attn.q"]
    f.replace_all_uses_with(source)
    graph.erase_node(f)
    program.graph_module.recompile()
    for rank, step in steps.items():
        program.replace_step_program(rank, drop_call(step, position))
    program.check()  # consistent: the ranks agree with each other, not with the math
    report = fxpar.verify(program, example_inputs=BATCH, timeout=20)
    first = report.first
    assert first is not None, str(report)
    assert (first.what, first.node, first.module_path) == ("gradient", source.name, "h.1.ln_1")
    assert report.compared["forward value"] > 80  # every forward value matched first
    assert f"first divergent: gradient of node {source.name} (module 'h.1.ln_1')" in str(report)


def test_verify_refuses_a_program_the_check_refuses_and_reports_each_ranks_failure():
    """A program whose ranks disagree would hang, not diverge: verify proves it first (no
    process is started). check=False runs it anyway: rank 1's guard stops its resized bucket
    before sending, rank 0 fails when its peer is gone, and the VerifyError lists both."""
    program = fxpar.compile(build_model(), "dp=2 bucket_mb=0.02", BATCH)
    program.replace_step_program(1, resize_call(program.step_program(1), 0, 7))  # bucket 0
    with pytest.raises(PlanError, match=r"process group \[0, 1\] does not match"):
        fxpar.verify(program, example_inputs=BATCH)
    with pytest.raises(fxpar.VerifyError) as failed:
        fxpar.verify(program, example_inputs=BATCH, check=False, timeout=3)
    message = str(failed.value)
    assert message.startswith("the parallel run of plan 'dp=2 bucket_mb=0.02' failed, so nothing was compared")
    assert "rank 1: StepProgramError: rank 1 was about to issue all_reduce(" in message
    assert "its step program's call #0 of its 4 on that group is all_reduce(7 x torch.float32" in message
    assert "rank 0: CollectiveError: all_reduce of gradient bucket 0" in message
    # rank 1 exits at once, so rank 0's backend sees it gone (or, on a slow machine, its 3 s pass)
    assert "rank 1 is gone" in message or "did not complete within 3 s" in message
    with pytest.raises(TypeError, match="takes no plan"):
        fxpar.verify(program, "dp=2", BATCH)


def test_dropout_is_verified_under_rng_exact_and_refused_under_rng_fast():
    """Both sides draw from one seed (`fxpar.tools.verify.SEED`). With rng=exact every rank draws
    exactly one device's dropout masks (residual and tp-sharded attention dropout), so the
    plan equals one device; under rng=fast each rank draws its own piece, and verify refuses
    before starting anything, naming the first draw. bf16 needs a tolerance of its own."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, dropout=0.1))
    with pytest.raises(fxpar.VerifyError, match=r"node random_like\w* \(fxpar.random_like, module 'drop'\) "
                                                r"draws random numbers \(p=0.1\), and plan rng=fast"):
        fxpar.verify(model, "tp=2", BATCH)
    report = fxpar.verify(model, "tp=2 rng=exact", BATCH, timeout=20)
    assert report.equal, str(report)
    with pytest.raises(PlanError, match="precision=bf16-mixed .* Fix: pass an rtol"):
        fxpar.verify(build_model(), "dp=2 precision=bf16-mixed", BATCH)
