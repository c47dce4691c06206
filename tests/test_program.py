"""Tier 1/4: compile, rank modules, predicted collectives and their static check, bind errors."""

import pickle
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar import BindError, PlanError
import fxpar
from fxpar.ir.collectives import Collective, check_collectives

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).parent / "workers"))
from gpt import GPT, GPTConfig  # noqa: E402
from step_program_edits import resize_call  # noqa: E402

CONFIG = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
TOKENS = torch.randint(0, 64, (8, 16))


def compile_gpt(plan: str) -> fxpar.Program:
    torch.manual_seed(0)
    return fxpar.compile(GPT(CONFIG), plan, example_inputs=(TOKENS, TOKENS))


def test_rank_module_prints_the_code_the_rank_runs():
    program = compile_gpt("dp=4")
    assert program.world_size == 4
    module = program.rank_module(3)
    assert module.meta["fxpar.coord"].dp == 3
    code = module.code
    # The mean loss is a sum over the step's global count of valid targets (loss_normalisation).
    assert "def forward(self, idx, targets, valid_targets)" in code
    assert "torch.ops.aten.scaled_dot_product_attention.default" in code
    assert "div_tensor = torch.ops.aten.div.Tensor(cross_entropy_loss, valid_targets)" in code
    assert code.rstrip().endswith("return div_tensor")
    with pytest.raises(ValueError, match="rank 4"):
        program.rank_module(4)


def test_collectives_cover_every_gradient_once_and_the_loss():
    program = compile_gpt("dp=4 bucket_mb=0.02")
    parameters = program.captured.parameter_count()
    calls = program.collectives(2)
    assert len(calls) == len(program.buckets) > 1  # the buckets alone
    assert {c.group for c in calls} == {(0, 1, 2, 3)}
    # The first carries the count of valid targets (two digits) and four step slots
    # (`lowering.ride_agreements`), the last the loss.
    assert calls[0].tag == "gradient bucket 0 + valid targets + step" and calls[0].agreement == 4
    assert sum(c.numel for c in calls) == parameters + 1 + 2 + 4
    assert calls[-1].tag.endswith("+ loss")
    program.check()


def test_one_replica_communicates_nothing():
    assert compile_gpt("dp=1").collectives(0) == ()


def test_check_names_the_group_and_ranks_of_a_mismatch():
    def collectives_of(rank):
        numel = 10 if rank != 1 else 12
        return [Collective(kind="all_reduce", group=(0, 1), numel=numel, dtype=torch.float32,
                           tag="gradient bucket 0")]

    with pytest.raises(PlanError, match=r"collective #0 on process group \[0, 1\].*rank 1 issues"):
        check_collectives(2, collectives_of)


def test_batch_not_divisible_is_a_plan_error_before_anything_runs():
    with pytest.raises(PlanError, match="batch"):
        compile_gpt("dp=3")


class _FixedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, y):
        return F.mse_loss(self.proj(x).view(8, 4), y)


def test_a_model_that_fixes_its_batch_cannot_be_split():
    with pytest.raises(PlanError, match="fixes the batch size to 8"):
        fxpar.compile(_FixedBatch(), "dp=2", example_inputs=(torch.randn(8, 4), torch.randn(8, 4)))


def test_bind_outside_torchrun_shows_the_command(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BindError, match="torchrun --standalone --nproc-per-node 2"):
        compile_gpt("dp=2").bind()


def test_bind_with_the_wrong_world_size_is_a_plan_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(PlanError, match="WORLD_SIZE is 3"):
        compile_gpt("dp=2").bind()


def test_plans_compiled_from_one_capture_share_its_single_export(monkeypatch):
    exports = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or export(*a, **k))
    torch.manual_seed(0)
    captured = fxpar.capture(GPT(CONFIG), (TOKENS, TOKENS))
    plans = ["dp=2", "dp=4 mb=2", "tp=2", "tp=2 sp=true", "pp=2 mb=2", "dp=2 pp=2 tp=2 mb=2"]
    for plan in plans:
        program = fxpar.compile(captured, plan)
        assert program.captured is captured and str(program.plan) == plan
        program.check()
    assert len(exports) == 1
    # The capture is left as it was: a plan compiled from it equals one compiled afresh.
    again = compile_gpt("tp=2")
    assert fxpar.compile(captured, "tp=2").rank_module(1).code == again.rank_module(1).code
    with pytest.raises(TypeError, match="takes no example_inputs"):
        fxpar.compile(captured, "dp=2", (TOKENS, TOKENS))


def test_the_pass_list_is_built_from_the_plan_and_printed():
    """One list per compile (fxpar.compiler.pass_list): the graph's passes, then each stage's."""
    assert [line.split("(")[0].split()[-1] for line in str(compile_gpt("dp=2").passes).splitlines()] == [
        "normalise_loss", "place_data_parallel", "assign_gradient_buckets"]
    printed = str(compile_gpt("tp=2 pp=2 mb=2 schedule=zb-h1").passes).splitlines()
    assert [line.split("(")[0].split()[-1] for line in printed] == [
        "normalise_loss", "shard_tensor_parallel", "place_data_parallel", "assign_stages",
        "defer_weight_gradients", "assign_gradient_buckets"]
    assert printed[0].startswith("graph: ") and printed[4].startswith("stage: ")


# -- what bind is given ----------------------------------------------------------------------------

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


@pytest.fixture(scope="module")
def data_parallel():
    """One dp=2 program for the bind checks, which all refuse before anything is bound."""
    return compile_gpt("dp=2")


@pytest.mark.parametrize(
    ("timeout", "error", "shown"),
    [(0, ValueError, "0"), (-1, ValueError, "-1"), (float("nan"), ValueError, "nan"),
     (float("inf"), ValueError, "inf"), ("5", TypeError, "'5'"), (True, TypeError, "True"),
     (__import__("datetime").timedelta(0), ValueError, "datetime.timedelta(0)")],
)
def test_bind_timeout_must_be_positive_finite_seconds(
    monkeypatch, data_parallel, timeout, error, shown
):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error, match=rf"bind\(timeout={re.escape(shown)}\).*Fix: bind\(timeout=300\)"):
        data_parallel.bind(timeout=timeout)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "7", True])
def test_bind_seed_must_be_an_int63(monkeypatch, data_parallel, seed):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(BindError, match=rf"bind\(seed={re.escape(repr(seed))}\): a seed is an int in \[0, 2\*\*63\)"):
        data_parallel.bind(timeout=30, seed=seed)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("RANK", "2", "RANK=2 is outside WORLD_SIZE=2: ranks are 0 to 1"),
        ("RANK", "-1", "RANK='-1' is not an integer of at least 0"),
        ("RANK", "zero", "RANK='zero' is not an integer of at least 0"),
        ("WORLD_SIZE", "0", "WORLD_SIZE='0' is not an integer of at least 1"),
        ("LOCAL_RANK", "x", "LOCAL_RANK='x' is not an integer of at least 0"),
        ("MASTER_PORT", "99999", "MASTER_PORT='99999' is not an integer from 1 to 65535"),
        ("MASTER_PORT", "http", "MASTER_PORT='http' is not an integer from 1 to 65535"),
        ("MASTER_ADDR", " ", "MASTER_ADDR is empty"),
        ("LOCAL_WORLD_SIZE", "1", "LOCAL_RANK=1 is outside LOCAL_WORLD_SIZE=1"),
    ],
)
def test_the_torchrun_environment_is_checked_before_any_group_exists(
    monkeypatch, data_parallel, name, value, expected
):
    for key, default in (TORCHRUN_ENV | {"RANK": "1", "LOCAL_RANK": "1"}).items():
        monkeypatch.setenv(key, default)
    monkeypatch.setenv(name, value)
    start = time.perf_counter()
    with pytest.raises(BindError, match=re.escape(expected)):
        data_parallel.bind(timeout=30)
    assert time.perf_counter() - start < 5  # no store, no network wait


def test_sequence_parallelism_needs_a_sequence_divisible_by_tp():
    tokens = torch.randint(0, 64, (8, 17))
    with pytest.raises(PlanError, match=r"sp=true shards the sequence over tp=2 ranks, and the "
                       r"example's sequence length 17 is not divisible by 2. Fix: use sequences "
                       r"of 16 or 18 tokens") as caught:
        fxpar.compile(GPT(CONFIG), "tp=2 sp=true", example_inputs=(tokens, tokens))
    assert caught.value.field == "sequence_parallel"
    fxpar.compile(GPT(CONFIG), "tp=2", example_inputs=(tokens, tokens))  # no sp: any length


def test_a_batch_of_one_warns_that_export_fixes_it():
    one = torch.randint(0, 64, (1, 16))
    with pytest.warns(UserWarning, match=r"example input 'idx' has size 1 in dim 0 \(the batch\); "
                      r"torch.export fixes sizes 0 and 1.*Fix: capture with an example of batch 2"):
        program = fxpar.compile(GPT(CONFIG), "tp=2", example_inputs=(one, one))
    assert program.captured.batch is None


# -- pickling --------------------------------------------------------------------------------------


def test_a_program_pickles_and_loads_by_compiling_again():
    torch.manual_seed(0)
    captured = fxpar.capture(GPT(CONFIG), (TOKENS, TOKENS))
    programs = [fxpar.compile(captured, plan) for plan in ("dp=2 tp=2", "pp=2 mb=2")]
    loaded = pickle.loads(pickle.dumps(programs))
    assert loaded[0].captured is loaded[1].captured  # one capture again, exported once
    for program, again in zip(programs, loaded):
        assert again.plan == program.plan and again.hardware == program.hardware
        for rank in range(program.world_size):
            assert again.rank_module(rank).code == program.rank_module(rank).code
            assert again.collectives(rank) == program.collectives(rank)
            state, loaded_state = program.rank_module(rank).state_dict(), again.rank_module(rank).state_dict()
            assert state.keys() == loaded_state.keys()
            assert all(torch.equal(state[k], loaded_state[k]) for k in state)
    assert loaded[0].estimate("h100").time["total"] == programs[0].estimate("h100").time["total"]
    # A step program edited by replace_step_program is data, and comes back with its program.
    programs[0].replace_step_program(1, resize_call(programs[0].step_program(1), 0, 7))
    again = pickle.loads(pickle.dumps(programs[0]))
    assert again.collectives(1) == programs[0].collectives(1) != loaded[0].collectives(1)


def test_zero_without_data_parallelism_warns_that_nothing_is_sharded():
    with pytest.warns(UserWarning, match="plan zero=3 shards model state .* and dp=1: nothing is sharded"):
        program = compile_gpt("zero=3")
    assert not any("gather_parameters" in c.tag for c in program.step_program(0).calls())


def test_a_bind_that_fails_after_the_groups_exist_destroys_them(monkeypatch):
    """A model on the meta device passes every check before the groups and fails placing its
    state: the process is left as it was, so a corrected bind can start again."""
    import socket

    import torch.distributed as dist

    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    tokens = torch.randint(0, 64, (2, 16))
    program = fxpar.compile(model, "dp=1", example_inputs=(tokens, tokens))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {**TORCHRUN_ENV, "WORLD_SIZE": "1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(fxpar.BindError, match="meta device, which is for planning only"):
        program.bind(timeout=10)
    assert not dist.is_initialized()


def test_the_program_runs_the_schedule_the_stage_cut_was_sized_by():
    """One schedule object per compile: the pass list builds it for the cut (its in-flight
    microbatches size each stage's memory) and the program lowers and proves with that same
    object, not a second one built from the plan again."""
    program = compile_gpt("pp=2 mb=4 schedule=interleaved virtual_stages=2")
    assert program.schedule is program.passes.schedule is not None
    unpipelined = compile_gpt("dp=2")
    assert unpipelined.schedule is None and unpipelined.passes.schedule is None
