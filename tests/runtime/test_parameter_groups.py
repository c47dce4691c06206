"""Tier 3: optimizer parameter groups under every kind of optimizer fxpar builds.

nanoGPT, Hugging Face's Trainer and most recipes step biases and norm weights without weight
decay. `runner.optimizer(cls, param_groups=[...])` takes torch.optim's groups, naming the
compiled model's Parameters or their names (`runtime.state.parameter_groups`).
`tiny_training.parameter_groups` decays the matrices and steps the rest without decay at a
tenth of the rate, so a parameter stepped in the wrong group moves far more than any
tolerance here (asserted on one device). Each plan trains 5 AdamW steps and is compared with
one device's AdamW over the same groups:

* fp32 plans: dp, ZeRO-1 (a shard that crosses both groups is cut into runs of one group),
  ZeRO-2 with microbatches and ZeRO-3 (pieces) on 2 ranks, groups given as Parameters; tp,
  pp with the tied head and ZeRO-1/2/3 with them on 4 ranks, groups given as names: losses and
  all parameters relative 1e-5 (sums of the same terms in another order, as in
  test_data_parallel_equivalence), and the full optimizer state, written by `write_full` and
  read by `load_full_optimizer_state`, loads into one device's grouped AdamW as its own
  state dict (options and parameters of each group, every moment, the step counts);
* bf16-mixed, with and without ZeRO-1, against the fp32 training: the ungrouped parameters'
  update within 0.2 of fp32's (test_lr_schedules's bf16 bound), where ungrouped training is
  far outside it;
* a torch.distributed.checkpoint saved under ZeRO-1 with groups and loaded under ZeRO-2 and
  under tp=2 continues as the uninterrupted run (a shard's runs saved and loaded as one);
* Muon for the hidden matrices and AdamW for the rest, two optimizers over disjoint
  parameters (torch.optim.Muon's advice), under dp and pp: trained as one device trains them,
  and saved and loaded as a list through a checkpoint under another plan;
* groups that name no parameter, one twice, or are not a list; ZeRO-1/2 groups that leave a
  trained parameter out; a runner whose optimizers step no group of a trained parameter: a
  PlanError (or a warning, for the last) naming the parameter and the fix.
"""

import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.frontend.trace import capture
from fxpar.runtime.checkpoint.full_file import load_full_optimizer_state, optimizer_path, write_full
from fxpar.runtime.state.parameter_groups import ParameterGroups

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import (  # noqa: E402
    OPTIMIZER, build_model, global_batches, muon_and_adamw, parameter_groups, train_single_device,
)

MUON_PLANS = ("dp=2", "pp=2 mb=2")

TWO_RANKS = ("dp=2", "dp=2 zero=1", "dp=2 zero=2 mb=2", "dp=2 zero=3")
BF16 = ("dp=2 precision=bf16-mixed", "dp=2 zero=1 precision=bf16-mixed")
FOUR_RANKS = ("dp=2 tp=2 zero=1", "tp=2 pp=2 mb=2", "dp=2 pp=2 zero=2 mb=2", "dp=2 tp=2 zero=3")
RELATIVE = 1e-5
BF16_UPDATE_RELATIVE = 0.2


def distance(state: dict, reference: dict, keys=None) -> float:
    """|state - reference| / |reference| over the tensors `keys` (all of reference's) together."""
    keys = list(reference) if keys is None else keys
    difference = torch.cat([(state[k].float() - reference[k].float()).flatten() for k in keys])
    return float(difference.norm() / torch.cat([reference[k].float().flatten() for k in keys]).norm())


def assert_trains_as_one_device(plan: str, result: dict, reference: dict, model_name: str, folder: Path) -> None:
    """Losses and parameters of one device's grouped training, and its optimizer's state dict
    from the full optimizer state through a safetensors file."""
    assert result["losses"] == pytest.approx(reference["losses"], rel=RELATIVE), plan
    assert distance(result["state"], reference["state"]) <= RELATIVE, plan
    path = folder / f"{plan.replace(' ', '_')}.safetensors"
    write_full(path, result["state"], result["optimizer"])
    model = build_model(model_name)
    optimizer = torch.optim.AdamW(parameter_groups(model), **OPTIMIZER)
    optimizer.load_state_dict(load_full_optimizer_state(optimizer_path(path), model))
    found, expected = optimizer.state_dict(), reference["optimizer_state_dict"]
    assert found["param_groups"] == expected["param_groups"], plan
    assert set(found["state"]) == set(expected["state"])
    moments = [(i, k) for i, s in expected["state"].items() for k, v in s.items() if v.dim() > 0]
    assert distance({m: found["state"][m[0]][m[1]] for m in moments},
                    {m: expected["state"][m[0]][m[1]] for m in moments}) <= RELATIVE
    assert all(float(found["state"][i]["step"]) == float(s["step"]) for i, s in expected["state"].items())


@pytest.fixture(scope="module")
def references():
    return {name: train_single_device(name, grouped=True) for name in ("llama", "gpt")}


@pytest.mark.multirank
def test_groups_train_as_one_device_on_two_ranks(torchrun, references, tmp_path):
    ranks = torchrun("train_worker.py", 2, *TWO_RANKS, *BF16, env={"FXPAR_TEST_GROUPS": "1", "FXPAR_TEST_MODEL": "llama"})
    reference = references["llama"]
    ungrouped = train_single_device("llama")
    model = build_model("llama")
    initial = model.state_dict()
    no_decay = [n for n, p in model.named_parameters() if p.dim() < 2]
    update = {k: reference["state"][k] - initial[k] for k in initial}

    def update_distance(state: dict) -> float:
        """How far `state`'s no-decay parameters are from grouped fp32 training's, over its update."""
        return distance({k: state[k] - initial[k] for k in initial}, update, no_decay)

    assert update_distance(ungrouped["state"]) > 3 * BF16_UPDATE_RELATIVE
    for results in ranks:
        for plan in TWO_RANKS:
            assert_trains_as_one_device(plan, results[plan], reference, "llama", tmp_path)
        for plan in BF16:
            assert update_distance(results[plan]["state"]) <= BF16_UPDATE_RELATIVE, plan
            assert [len(g["params"]) for g in results[plan]["optimizer"]["param_groups"]] == [
                len(g["params"]) for g in reference["optimizer_state_dict"]["param_groups"]]
    # ZeRO-1's shards cross from the matrices into the norms: cut into more tensors than shards.
    zero1 = ranks[0]["dp=2 zero=1"]
    assert zero1["stepped_tensors"] > len(zero1["buckets"])


@pytest.mark.multirank
def test_groups_by_name_with_tensor_and_pipeline_parallelism(torchrun, references, tmp_path):
    ranks = torchrun("train_worker.py", 4, *FOUR_RANKS, env={"FXPAR_TEST_GROUPS": "names"})
    reference = references["gpt"]
    for results in ranks:
        for plan in FOUR_RANKS:
            assert_trains_as_one_device(plan, results[plan], reference, "gpt", tmp_path)


@pytest.mark.multirank
def test_a_grouped_checkpoint_loads_under_other_plans(torchrun, references):
    jobs = ("save|dp=2 zero=1|g|3+2", "load|dp=2 zero=2|g|2", "load|tp=2|g|2")
    ranks = torchrun("checkpoint_worker.py", 2, *jobs, env={"FXPAR_TEST_GROUPS": "1"})
    reference = references["gpt"]
    for results in ranks:
        uninterrupted = results[jobs[0]]
        assert uninterrupted["losses"] + uninterrupted["losses_after"] == pytest.approx(reference["losses"], rel=RELATIVE)
        for job in jobs[1:]:
            result = results[job]
            assert result["losses"] == pytest.approx(reference["losses"][3:], rel=RELATIVE), job
            assert distance(result["state"], reference["state"]) <= RELATIVE, job
            assert [g["lr"] for g in result["optimizer"]["param_groups"]] == [OPTIMIZER["lr"], OPTIMIZER["lr"] / 10]


@pytest.fixture(scope="module")
def captured():
    return capture(build_model("gpt"), global_batches()[0])


def test_names_and_parameters_resolve_alike(captured):
    model = captured._source[0]
    by_parameter = ParameterGroups.resolve(parameter_groups(model), captured.parameters, captured.aliases)
    name_of = {id(p): n for n, p in model.named_parameters()}
    by_name = ParameterGroups.resolve([g | {"params": [name_of[id(p)] for p in g["params"]]}
                                       for g in parameter_groups(model)], captured.parameters, captured.aliases)
    assert by_parameter == by_name and len(by_name.names) == 2
    assert by_name.options[1] == {"weight_decay": 0.0, "lr": OPTIMIZER["lr"] / 10}
    (alias, canonical), = captured.aliases.items()  # the GPT's head, tied to its embedding
    assert by_name.group_of(alias) == by_name.group_of(canonical) == 0


def _error(captured, groups) -> str:
    with pytest.raises(fxpar.PlanError) as error:
        ParameterGroups.resolve(groups, captured.parameters, captured.aliases)
    assert error.value.field == "param_groups" and "Fix:" in str(error.value)
    return str(error.value)


def test_bad_groups_name_the_parameter_and_the_fix(captured):
    names = list(captured.parameters)
    first, rest = names[0], names[1:]
    assert "did you mean" in _error(captured, [{"params": [first + "x", *rest]}])
    assert f"{rest[0]!r}, already in param_groups[0]" in _error(captured, [{"params": names}, {"params": rest[:1]}])
    assert "shape (3,)" in _error(captured, [{"params": [torch.nn.Parameter(torch.zeros(3)), *names]}])
    assert "list of dicts" in _error(captured, {"params": names})
    assert "not a dict with 'params'" in _error(captured, [{"weight_decay": 0.0}])


def test_a_frozen_parameter_may_be_left_out():
    model = build_model("gpt")
    frozen = next(n for n, p in model.named_parameters() if p.dim() < 2)
    model.get_parameter(frozen).requires_grad_(False)
    captured = capture(model, global_batches()[0])
    groups = ParameterGroups.resolve([{"params": [n for n in captured.parameters if n != frozen]}],
                                     captured.parameters, captured.aliases)
    assert groups.group_of(frozen) is None


def _max_relative(values, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


@pytest.mark.multirank
def test_muon_for_the_matrices_and_adamw_for_the_rest(torchrun):
    """Muon orthogonalises its update in bf16 (torch.optim.Muon's Newton-Schulz iteration), so
    gradients that agree to float rounding give updates that differ by bf16 roundings: one
    device whose batches are summed in two halves ends 2.4e-3 from its whole-batch run (and
    its losses 1e-6 apart). That is the noise fxpar is held to (within 3 times it), where
    AdamW alone ends 100 times further; and each optimizer's full state holds exactly its own
    parameters."""
    ranks = torchrun("train_worker.py", 2, *MUON_PLANS, env={"FXPAR_TEST_OPTIMIZERS": "muon"})
    reference, halves = train_single_device("gpt", muon=True), train_single_device("gpt", muon=True, split=2)
    noise = distance(halves["state"], reference["state"])
    loss_noise = _max_relative(halves["losses"], reference["losses"])
    assert 0 < noise < 1e-2 and distance(train_single_device("gpt")["state"], reference["state"]) > 30 * noise
    model = build_model("gpt")
    name_of = {id(p): n for n, p in model.named_parameters()}
    muon_names, adamw_names = ({name_of[id(p)] for p in stepped} for stepped in muon_and_adamw(model))
    for results in ranks:
        for plan in MUON_PLANS:
            result = results[plan]
            assert distance(result["state"], reference["state"]) <= 3 * noise, plan
            assert _max_relative(result["losses"], reference["losses"]) <= 3 * loss_noise, plan
            muon, adamw = result["optimizer"]
            assert set(muon["state"]) == muon_names and set(adamw["state"]) == adamw_names, plan
            assert all(set(s) == {"momentum_buffer"} for s in muon["state"].values()), plan


@pytest.mark.multirank
def test_a_list_of_optimizers_checkpoints_under_one_plan_and_resumes_under_another(torchrun):
    """Muon's and AdamW's states are saved as a list under dp=2 and loaded under pp=2: right
    after the load both full states equal what was saved, to the bit; `save_full` wrote each
    one's in a file of its own, which one device's Muon and AdamW load."""
    jobs = ("save|dp=2|m|3", "load|pp=2 mb=2|m|2")
    for results in torchrun("checkpoint_worker.py", 2, *jobs, env={"FXPAR_TEST_OPTIMIZERS": "muon"}):
        saved, loaded = results[jobs[0]]["saved_optimizer"], results[jobs[1]]["loaded_optimizer"]
        assert len(saved) == len(loaded) == 2
        for before, after in zip(saved, loaded):
            assert before["param_groups"] == after["param_groups"]
            assert set(before["state"]) == set(after["state"]) and before["state"]
            assert all(torch.equal(before["state"][n][k], after["state"][n][k])
                       for n in before["state"] for k in before["state"][n])
        assert torch.equal(torch.cat([v.flatten() for v in results[jobs[0]]["saved"].values()]),
                           torch.cat([v.flatten() for v in results[jobs[1]]["loaded"].values()]))
        assert len(results[jobs[1]]["losses"]) == 2
        model = build_model("gpt")
        for index, (stepped, kind) in enumerate(zip(muon_and_adamw(model), (torch.optim.Muon, torch.optim.AdamW))):
            optimizer = kind(stepped)
            optimizer.load_state_dict(load_full_optimizer_state(
                optimizer_path(results["folder"] / "m.safetensors", index), model))
            name_of = {id(p): n for n, p in model.named_parameters()}
            assert all(torch.equal(optimizer.state[p][k], saved[index]["state"][name_of[id(p)]][k])
                       for p in stepped for k in saved[index]["state"][name_of[id(p)]])


def test_zero_1_and_2_refuse_groups_that_leave_a_trained_parameter_out():
    from types import SimpleNamespace

    from fxpar.runtime.state.sharded_optimizer import ShardedOptimizer

    bucket = SimpleNamespace(bucket=SimpleNamespace(parameters=["h.0.w", "h.0.b"]))
    context = SimpleNamespace(buckets=[SimpleNamespace(zero=2, states=[bucket])])
    groups = ParameterGroups((("h.0.w",),), ({},), {})
    with pytest.raises(fxpar.PlanError, match="leave out 'h.0.b'.*Fix: one optimizer") as error:
        ShardedOptimizer(torch.optim.AdamW, {}, context=context, flats=[], groups=groups)
    assert error.value.field == "zero"


def test_a_trained_parameter_no_optimizer_steps_is_warned_of():
    from fxpar.runtime.state.parameter_groups import warn_unstepped

    with pytest.warns(UserWarning, match=r"'h.0.b' \(and 1 more\) is in no group.*requires_grad=False"):
        assert warn_unstepped(["h.0.b", "h.1.b"]) == []


def test_a_load_is_given_the_optimizers_the_checkpoint_holds(tmp_path):
    from fxpar.runtime.checkpoint.save_load import _saved_optimizers

    manifest = {"optimizer": [{"class": "Muon", "param_groups": [{}]}, {"class": "AdamW", "param_groups": [{}]}]}
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(fxpar.CheckpointError, match=r"2 optimizer\(s\) \(Muon, AdamW\); load was given 1"):
        _saved_optimizers(adamw, manifest, tmp_path)
    assert _saved_optimizers([adamw, adamw], manifest, tmp_path) == manifest["optimizer"]


def test_a_shard_is_cut_where_the_group_of_its_parameters_changes():
    """`group_runs` over the shard [4, 14) of a bucket laid out as w [0, 6), b [6, 8), v [8, 12)
    and 2 elements of padding, with w and v in group 0 and b in group 1: one run per change of
    group, the padding riding with the last; one group keeps the shard whole; a shard of
    padding alone is one run in the group of the bucket's last parameter."""
    from types import SimpleNamespace

    from fxpar.runtime.state.sharded_optimizer import group_runs

    def buckets(spans, parameters=("w", "b", "v")):
        return SimpleNamespace(shard_spans=lambda index: iter(spans),
                               states=[SimpleNamespace(bucket=SimpleNamespace(parameters=list(parameters)))])

    groups = ParameterGroups((("w", "v"), ("b",)), ({}, {"weight_decay": 0.0}), {})
    shard = torch.arange(10.0)
    spans = [("w", None, 4, 0, 2), ("b", None, 0, 2, 4), ("v", None, 0, 4, 8)]
    runs = group_runs(buckets(spans), 0, shard, groups)
    assert [(r.start, r.stop, r.group) for r in runs] == [(0, 2, 0), (2, 4, 1), (4, 10, 0)]
    assert all(r.tensor.data_ptr() == shard[r.start:].data_ptr() for r in runs)  # views of the shard
    one = ParameterGroups((("w", "b", "v"),), ({},), {})
    assert [(r.start, r.stop) for r in group_runs(buckets(spans), 0, shard, one)] == [(0, 10)]
    padding = group_runs(buckets([]), 0, shard, groups)
    assert [(r.start, r.stop, r.group) for r in padding] == [(0, 10, 0)]
