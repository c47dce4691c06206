"""Tier 1/4: compile, rank modules, predicted collectives and their static check, bind errors."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar import BindError, PlanError
from fxpar.collectives import Collective, check_collectives

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

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
    count, *calls = program.collectives(2)
    assert (count.tag, count.numel, count.dtype) == ("valid targets", 1, torch.int64)
    assert len(calls) == len(program.buckets) > 1
    assert {c.group for c in (count, *calls)} == {(0, 1, 2, 3)}
    assert sum(c.numel for c in calls) == parameters + 1  # + the loss in the last bucket
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


@pytest.mark.parametrize("plan, field", [("dp=2 zero=1", "zero"), ("precision=bf16-mixed", "precision")])
def test_check_and_bind_refuse_plan_fields_only_the_cost_model_supports(plan, field):
    program = compile_gpt(plan)
    for step in (program.check, program.bind):
        with pytest.raises(PlanError, match=f"plan {field}=.*program.estimate") as error:
            step()
        assert error.value.field == field
    assert program.estimate("h100").time["total"] > 0


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
    """One list per compile (fxpar.pass_list): the graph's passes, then each stage's."""
    assert [line.split("(")[0].split()[-1] for line in str(compile_gpt("dp=2").passes).splitlines()] == [
        "normalise_loss", "place_data_parallel", "assign_gradient_buckets"]
    printed = str(compile_gpt("tp=2 pp=2 mb=2 schedule=zb-h1").passes).splitlines()
    assert [line.split("(")[0].split()[-1] for line in printed] == [
        "normalise_loss", "shard_tensor_parallel", "place_data_parallel", "assign_stages",
        "defer_weight_gradients", "assign_gradient_buckets"]
    assert printed[0].startswith("graph: ") and printed[4].startswith("stage: ")
