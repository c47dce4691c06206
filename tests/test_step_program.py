"""Tier 1/4: the step program is the one list: collectives, check and the runtime's guard read it.

An edit of one rank's step program (a dropped, swapped or resized call) is seen by `check()`,
which names the group, the two ranks and the position, and by the runtime's step guard, which
stops the edited rank before the call is made (the multi-rank half is in
tests/runtime/test_failures.py).
"""

import math
import sys
from pathlib import Path

import pytest
import sympy
import torch

import fxpar
from fxpar.errors import PlanError, StepProgramError
from fxpar.ir import meta
from fxpar.ir.placement import Shard
from fxpar.ir.step_program import Communicate, Compute, Exchange, Purpose
from fxpar.runtime.step.guard import StepGuard

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from step_program_edits import drop_call, resize_call, swap_actions  # noqa: E402
from tiny_training import build_model, global_batches  # noqa: E402

TOKENS, LABELS = global_batches()[0]


@pytest.fixture(scope="module")
def data_parallel():
    return fxpar.compile(build_model(), "dp=2 bucket_mb=0.02", (TOKENS, LABELS))


def _buckets(program) -> list[int]:
    """Positions of the gradient-bucket actions of rank 1's step program."""
    return [i for i, a in enumerate(program.actions)
            if isinstance(a, Communicate) and a.purpose is Purpose.GRADIENT_BUCKET]


def test_the_step_program_lists_every_action_and_collectives_are_its_calls(data_parallel):
    step = data_parallel.step_program(1)
    kinds = [type(a).__name__ if not isinstance(a, Compute) else a.kind for a in step.actions]
    assert kinds[:3] == ["F", "B", "Communicate"]  # the one microbatch, then the buckets
    assert step.actions[2].purpose is Purpose.GRADIENT_BUCKET  # the count and steps ride in it
    assert len(_buckets(step)) == len(data_parallel.buckets) > 2
    assert data_parallel.collectives(1) == step.collectives(data_parallel.example_sizes)


def test_ranks_of_one_pipeline_row_share_their_actions():
    program = fxpar.compile(build_model(), "dp=2 pp=2 tp=2 mb=2", (TOKENS, LABELS))
    rows = {r: program.step_program(r).actions for r in range(8)}
    assert rows[0] is rows[1] is rows[4] is rows[5]  # pipeline rank 0
    assert rows[2] is rows[3] is rows[6] is rows[7]
    assert rows[0] is not rows[2]
    assert any(isinstance(a, Exchange) for a in rows[0])
    program.check()


@pytest.mark.parametrize("edit", ["drop", "swap", "resize"])
def test_an_edited_rank_is_seen_by_the_check_and_by_the_guard(data_parallel, edit):
    original = data_parallel.step_program(1)
    first, second = _buckets(original)[:2]
    position = sum(len(a.calls) for a in original.actions[:first])  # bucket 0's call
    edited = {
        "drop": lambda: drop_call(original, position),
        "swap": lambda: swap_actions(original, first, second),
        "resize": lambda: resize_call(original, position, 7),
    }[edit]()
    data_parallel.replace_step_program(1, edited)
    try:
        with pytest.raises(PlanError, match=r"process group \[0, 1\] does not match: rank 0 issues .*, rank 1 issues"):
            data_parallel.check()
    finally:
        data_parallel._edited.clear()
    data_parallel.check()  # the original program passes
    # The runtime issues what the graph and its buckets do: the original calls. The guard of
    # the edited program stops the first that differs, before it is made.
    guard = StepGuard(edited)
    guard.start(data_parallel.example_sizes)
    with pytest.raises(StepProgramError, match=r"rank 1 was about to issue all_reduce.*gradient bucket"):
        for call in original.collectives(data_parallel.example_sizes):
            guard.admit(*call.signature(), call.tag)
        guard.finish()


def test_the_guard_reports_a_listed_call_that_was_never_made(data_parallel):
    step = data_parallel.step_program(0)
    guard = StepGuard(step)
    guard.start(data_parallel.example_sizes)
    *made, last = step.collectives(data_parallel.example_sizes)
    for call in made:
        guard.admit(*call.signature(), call.tag)
    with pytest.raises(StepProgramError, match=r"finished its step without issuing all_reduce"):
        guard.finish()


def test_payloads_are_formulas_evaluated_at_each_step_size():
    program = fxpar.compile(build_model(), "tp=2", (TOKENS, LABELS))
    step = program.step_program(0)
    forward = step.computes()[0].calls
    assert forward and all(not isinstance(c.numel, int) for c in forward)  # batch x seq x ...
    small = program.microbatch_sizes((TOKENS[:2, :8], LABELS[:2, :8]))
    agreement, *calls = step.collectives(small)
    # The step agreement has one size at every step size: a step number, a fingerprint and
    # the four dims of the two inputs per rank (`runtime.step.batch_identity`).
    assert (agreement.tag, agreement.numel) == ("step agreement on tp + batch", 2 * (1 + 1 + 4))
    assert agreement == program.collectives(0)[0]
    assert [c.numel for c in calls] == [
        c.numel // 8 for c in program.collectives(0)[1:]  # a quarter of the batch, half the seq
    ]
    assert torch.float32 in {c.dtype for c in calls}


def test_tp_and_pp_agreements_keep_their_own_call_carrying_the_batch_identity():
    """`lowering.step_start_actions`: the ranks of a tp group and of a pipeline must be given one
    batch, so their agreement carries its identity (a fingerprint and the inputs' sizes) in a
    call of its own, of one size whatever the batch, first on its axis; it never rides in a
    call whose size depends on the batch (`ride_agreements` is dp's alone)."""
    for plan, axis in (("tp=2", "tp"), ("tp=2 sp=true", "tp"), ("pp=2 mb=2", "pp")):
        program = fxpar.compile(build_model(), plan, (TOKENS, LABELS))
        step = program.step_program(0)
        first = next(a for a in step.actions if isinstance(a, Communicate))
        assert first.purpose is Purpose.STEP_AGREEMENT and first.calls[0].axis == axis, plan
        assert (first.calls[0].batch, first.calls[0].numel) == (5, 2 * 6), plan
        assert not any(c.agreement for c in step.calls()), plan


def test_the_dp_count_and_agreement_ride_in_the_first_bucket_or_keep_their_own_call():
    """`lowering.ride_agreements` on dp: DDP's first bucket carries the count of valid targets
    (two digits) and the step numbers (a slot per rank), so a step makes no call but its
    buckets, as DDP. ZeRO's reduce-scatters cannot carry them; a pipeline's count keeps its
    call (the stages before the last do not count), while their agreement rides."""
    def first_dp_action(step):
        return next(a for a in step.actions if isinstance(a, Communicate) and a.calls[0].axis == "dp")

    riding = fxpar.compile(build_model(), "dp=2", (TOKENS, LABELS)).step_program(0)
    bucket = first_dp_action(riding)
    assert bucket.purpose is Purpose.GRADIENT_BUCKET and bucket.index == 0
    assert (bucket.calls[0].count, bucket.calls[0].agreement, riding.count_slots()) == (2, 2, 2)
    zero = fxpar.compile(build_model(), "dp=2 zero=1", (TOKENS, LABELS)).step_program(0)
    assert first_dp_action(zero).purpose is Purpose.VALID_TARGETS and zero.count_slots() == 0
    pipeline = fxpar.compile(build_model(), "dp=2 pp=2 mb=2", (TOKENS, LABELS))
    first, last = (pipeline.step_program(pipeline.mesh.rank_of(dp=0, pp=p, tp=0)) for p in (0, 1))
    assert first_dp_action(last).purpose is Purpose.VALID_TARGETS
    carrier = first_dp_action(first)
    assert carrier.purpose is Purpose.GRADIENT_BUCKET and (carrier.calls[0].count, carrier.calls[0].agreement) == (0, 2)
    pipeline.check()


def test_gathering_the_full_state_is_a_program_too():
    """tp shards gathered, then each pipeline rank's whole tensors broadcast per dtype: every
    key of the model's state dict travels, with sizes known at compile time (nothing pickled)."""
    model = build_model()
    program = fxpar.compile(model, "pp=2 tp=2 mb=2", (TOKENS, LABELS))
    sharded = {name for name, node in meta.parameter_nodes(program.graph_module.graph).items()
               if isinstance(meta.placement(node, "tp"), Shard)} | {"lm_head.weight"}  # tied to wte
    for rank in range(program.world_size):
        actions = program.state_program(rank).actions
        shards = {a.name for a in actions if a.purpose is Purpose.TP_SHARDS}
        assert shards and shards <= sharded  # this rank's stage's split tensors
        assert all(a.calls[0].axis == "tp" for a in actions if a.purpose is Purpose.TP_SHARDS)
        broadcasts = [a for a in actions if a.purpose is Purpose.STAGE_STATE]
        assert [a.index for a in broadcasts] == [0, 1]  # one dtype: float32
        assert {key for a in broadcasts for key, _ in a.entries} == set(model.state_dict())
        for a in broadcasts:
            shapes = dict(a.entries)
            assert all(tuple(model.state_dict()[k].shape) == shapes[k] for k in shapes)
            assert a.calls[0].numel == sum(model.state_dict()[k].numel() for k in shapes)
    gradients = program.state_program(0, gradients=True).actions
    assert {key for a in gradients if a.purpose is Purpose.STAGE_STATE for key, _ in a.entries} == {
        n for n, p in model.named_parameters()}
    program.check()  # the state programs match across ranks too


def test_zero_lowers_reduce_scatters_then_held_buckets_then_the_optimizers_gathers():
    """ZeRO-1/2: buckets reduce-scatter (padded to a multiple of dp); a parameter summed at the
    step's end (tp partial gradients under sp) is held in a bucket of its own until after that
    sum; the optimizer part gathers every bucket's updated parameters."""
    program = fxpar.compile(build_model(), "dp=2 tp=2 sp=true zero=2", (TOKENS, LABELS))
    step = program.step_program(0)
    purposes = [a.purpose for a in step.actions if isinstance(a, Communicate)]
    partial = purposes.index(Purpose.PARTIAL_GRADIENTS)
    held = {b.index for b in program.buckets if b.held}
    assert held and all(not b.held or len(b.parameters) == 1 for b in program.buckets)
    buckets = [a for a in step.actions if isinstance(a, Communicate) and a.purpose is Purpose.GRADIENT_BUCKET]
    assert [a.index in held for a in buckets] == sorted(a.index in held for a in buckets)  # held last
    assert purposes.index(next(p for p in purposes if p is Purpose.GRADIENT_BUCKET)) < partial
    assert all(a.calls[0].kind == "reduce_scatter" and a.calls[0].numel % 2 == 0 for a in buckets)
    assert [a.index for a in step.optimizer] == [b.index for b in program.buckets]
    assert all(a.purpose is Purpose.UPDATED_PARAMETERS for a in step.optimizer)
    program.check()


def test_an_optimizer_that_reads_whole_tensors_is_refused_under_zero():
    from types import SimpleNamespace

    from fxpar.runtime.state.sharded_optimizer import ShardedOptimizer

    context = SimpleNamespace(buckets=[SimpleNamespace(zero=1)])
    with pytest.raises(PlanError, match="zero=1 .* LBFGS is not known to .* elementwise=True"):
        ShardedOptimizer(torch.optim.LBFGS, {}, context=context, flats=[], groups=None)


def test_a_broken_send_and_a_dropped_graph_call_are_named_with_ranks_and_modules():
    """The proof names the two ranks, the position and both calls, a graph call with the
    module that issues it."""
    program = fxpar.compile(build_model(), "pp=2 tp=2 mb=2", (TOKENS, LABELS))
    step = program.step_program(0)
    send = next(i for i, c in enumerate(step.calls()) if c.kind == "send")
    program.replace_step_program(0, drop_call(step, send))
    with pytest.raises(PlanError, match=r"rank 0 sends 1 tensors to rank 2, which receives 2: transfer #1 "
                                        r"is nothing on rank 0's side and recv\(2048 x torch.float32"):
        program.check()
    graph_call = next(i for i, c in enumerate(step.calls()) if c.where.startswith("h."))
    program.replace_step_program(0, drop_call(step, graph_call))
    with pytest.raises(PlanError, match=r"process group \[0, 1\] does not match: .* in module 'h\.0\."):
        program.check()


def test_the_proof_costs_the_pipeline_degree_not_the_world_size():
    """Ranks of one pipeline row share their actions, so compile proves 65,536 ranks (dp=256
    tp=16 pp=16) by comparing one representative per row; tier 4, on the meta device."""
    import time

    from gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=16, n_head=16, n_embd=64, vocab_size=256, block_size=8))
    tokens = torch.randint(0, 256, (4096 * 16, 8))
    captured = fxpar.capture(model, (tokens, tokens))
    start = time.perf_counter()
    program = fxpar.compile(captured, "dp=256 tp=16 pp=16 mb=16")  # proves as it compiles
    program.check()
    assert program.world_size == 65_536 and time.perf_counter() - start < 30


def test_a_transfer_call_holds_the_shape_the_executor_allocates_and_the_size_the_check_reads():
    """The pipeline executor allocates each receive buffer from its call's `shape`; the check,
    the guard and the cost model read its `numel`. One call carries both, derived once from
    the boundary's placement. Under sequence parallelism the residual stream crossing the cut
    is sharded on tp along the sequence: each rank moves (batch / mb, seq / tp, hidden)."""
    program = fxpar.compile(build_model(), "pp=2 tp=2 sp=true mb=2", (TOKENS, LABELS))
    half = TOKENS.shape[0] // 2
    sizes = program.microbatch_sizes((TOKENS[:half], LABELS[:half]))  # one of the two microbatches
    hidden = program.stages[1].inputs[0].shape[-1]
    transfers = [c for r in range(program.world_size) for a in program.step_program(r).actions
                 if isinstance(a, Exchange) for c in a.calls]
    assert {c.kind for c in transfers} == {"send", "recv"}
    for call in transfers:
        assert math.prod(call.shape) == call.numel
        assert tuple(int(sympy.sympify(d).subs(sizes)) for d in call.shape) == (
            half, TOKENS.shape[1] // 2, hidden)
