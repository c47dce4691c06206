"""Checkpoints: runner.save / runner.load reshard across plans, save_full, resume after SIGKILL.

The multi-rank checks train the tiny GPT K=3 steps under one plan, save, load under another
plan (other dp / tp / pp / zero degrees, ZeRO-3's flat pieces among them, another world size) into a model built from another
seed, and train the remaining 2 steps: the losses of those steps, all parameters and the
optimizer state after them must be one device's uninterrupted 5 steps (tiny_training), to the
equivalence tests' relative 1e-5 (a resharded run sums gradients in another order than one
device, a few ulps a step; tests/runtime/test_data_parallel_equivalence.py says why parameters
and moments are compared all together). The resume test runs the example trainer twice under
one plan, once with a rank SIGKILLed mid-training and restarted by torchrun: the final
parameters and optimizer state must be the same to the bit (the same plan runs the same
arithmetic), asserted as rel 1e-5 only so that the message shows the numbers if not.
"""

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel_equivalence import assert_optimizer_state_equal  # noqa: E402
from tiny_training import OPTIMIZER, build_model, global_batches, train_single_device  # noqa: E402

from fxpar.errors import CheckpointError  # noqa: E402
from fxpar.ir.placement import FlatShard, Placements, R, Shard, local_slice  # noqa: E402
from fxpar.runtime.checkpoint.dcp_io import read_checkpoint_metadata, replace_folder  # noqa: E402
from fxpar.runtime.checkpoint.full_file import load_full_optimizer_state, optimizer_path  # noqa: E402
from fxpar.runtime.checkpoint.pieces import flat_range_pieces, row_major_boxes, tensor_pieces  # noqa: E402
from fxpar.runtime.checkpoint.save_load import latest_checkpoint, read_manifest  # noqa: E402

RELATIVE = 1e-5
TRAINER = Path(__file__).parents[2] / "examples" / "train_gpt.py"


# -- where a rank's pieces lie (no processes) ---------------------------------------------------

def test_row_major_boxes_tile_a_flat_range_in_order():
    shape = (3, 4, 5)
    whole = torch.arange(60).view(shape)
    for start, stop in [(0, 60), (7, 8), (7, 53), (20, 40), (19, 41), (4, 5), (0, 1), (59, 60)]:
        boxes = row_major_boxes(shape, start, stop)
        values = [whole[tuple(slice(o, o + s) for o, s in zip(off, size))].flatten() for off, size in boxes]
        assert torch.equal(torch.cat(values), torch.arange(start, stop)), (start, stop, boxes)
    assert row_major_boxes((4, 6), 5, 20) == [((0, 5), (1, 1)), ((1, 0), (2, 6)), ((3, 0), (1, 2))]


@pytest.mark.parametrize("shape, placements", [
    ((8, 12), Placements()), ((8, 12), Placements(tp=Shard(0))), ((8, 12), Placements(tp=Shard(1))),
    ((8, 12), Placements(tp=Shard(1, parts=3))), ((8, 12), Placements(dp=Shard(0), tp=Shard(1, parts=3))),
    ((5, 6), Placements(dp=FlatShard(), tp=Shard(1, parts=3))),  # ZeRO-3: 15 elements, 8 + 7 and a pad
    ((5, 7), Placements(dp=FlatShard())),
])
def test_pieces_hold_the_global_elements_at_their_offsets(shape, placements):
    """Every rank's pieces, of its local tensor and (without a FlatShard) of any flat range of
    it (a ZeRO-1/2 shard), are views holding the global tensor's elements at the pieces'
    offsets, and all ranks' pieces tile the global tensor once per replica."""
    whole = torch.arange(math.prod(shape), dtype=torch.float32).view(shape) + 1
    sizes = {"dp": 2, "tp": 2}
    covered = torch.zeros_like(whole)
    for dp in range(2):
        for tp in range(2):
            coord = {"dp": dp, "tp": tp}
            local = local_slice(whole, placements, coord, sizes).clone()
            pieces = tensor_pieces(local, shape, placements, coord, sizes)
            for piece in pieces:
                assert torch.equal(piece.view, _at(whole, piece)), piece
                assert piece.view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            if isinstance(placements.dp, FlatShard):
                for piece in pieces:
                    _at(covered, piece).add_(1)
                continue
            flat = local.flatten()
            cut = flat.numel() // 3 + 1  # a range boundary inside a row
            for start, stop in ((0, cut), (cut, flat.numel())):
                for piece in flat_range_pieces(flat[start:stop], start, local.shape, placements, coord, sizes, shape):
                    assert torch.equal(piece.view, _at(whole, piece)), piece
                    # a view of the shard, not a copy: loading writes through it
                    assert piece.view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                    _at(covered, piece).add_(1)
    replicas = (2 if placements.dp == R else 1) * (2 if placements.tp == R else 1)
    assert torch.equal(covered, torch.full_like(whole, replicas))  # once per replica of each shard


def _at(tensor, piece):
    return tensor[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))]


# -- folders, manifests, what is never unpickled ------------------------------------------------

def _fake_checkpoint(folder: Path, step: int | None) -> Path:
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    (folder / "fxpar.json").write_text(json.dumps({"format": "fxpar-checkpoint", "version": 1, "step": step,
                                                   "plan": "dp=1", "world_size": 1}))
    return folder


def test_latest_checkpoint_skips_partial_and_incomplete_folders(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    _fake_checkpoint(tmp_path / "step-00000002", 2)
    newest = _fake_checkpoint(tmp_path / "step-00000004", 4)
    _fake_checkpoint(tmp_path / "step-00000006.partial", 6)  # a save that did not finish
    (tmp_path / "step-00000008").mkdir()  # no manifest: never completed
    (tmp_path / "step-00000008" / ".metadata").write_bytes(b"junk")
    assert latest_checkpoint(tmp_path) == newest


def test_missing_and_incomplete_checkpoints_are_clear_errors(tmp_path):
    (tmp_path / "step-5.partial").mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*step-5 \(.*step-5.partial is a save that did not finish\)"):
        read_manifest(tmp_path / "step-5")
    with pytest.raises(CheckpointError, match="checkpoints in .*: step-5.partial"):
        read_manifest(tmp_path / "other")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a complete fxpar checkpoint: it lacks fxpar.json"):
        read_manifest(tmp_path / "half")


def test_a_checkpoint_replaced_in_place_is_never_half_there(tmp_path):
    """Saving over an existing checkpoint moves the old one aside, renames the new one in,
    then removes the old: at every moment one complete folder answers to the name."""
    old, new = tmp_path / "latest", tmp_path / "latest.partial"
    old.mkdir()
    (old / "a").write_text("old")
    new.mkdir()
    (new / "b").write_text("new")
    replace_folder(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert [p.name for p in old.iterdir()] == ["b"]


class _RunsCode:
    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_checkpoint_metadata_that_would_run_code_is_refused(tmp_path):
    """`.metadata` is a pickle (DCP's format): its allow-list refuses anything but DCP's own
    classes, before calling it."""
    marker = tmp_path / "was-executed"
    payload = _RunsCode()
    payload.marker = str(marker)
    folder = _fake_checkpoint(tmp_path / "evil", 1)
    (folder / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match=r"refers to (os|posix)\.makedirs.*does not unpickle it"):
        read_checkpoint_metadata(folder)
    assert not marker.exists()


# -- multi-rank: save under one plan, load under others -----------------------------------------

SAVES_2 = ["save|dp=2 zero=1|a|3", "save|tp=2|b|3", "save|dp=2 zero=1|g|3|gpt2", "save|dp=2 zero=3|z|3",
           "save|cp=2|p|3", "save|dp=2 ep=2|e|3|mixtral", "save|dp=2|x|3|mixtral",
           "save|dp=2 ep=2 zero=1|f|3|mixtral"]
LOADS_2 = ["load|tp=2|a|2", "load|pp=2 mb=2|a|2", "load|dp=2 zero=2|b|2", "load|tp=2|g|2|gpt2",
           "load|dp=2 zero=3|b|2", "load|tp=2|z|2",
           "load|cp=2|a|2", "load|dp=2 zero=3|p|2",  # into and out of context parallelism
           # out of and into expert parallelism: each rank's experts, whole experts
           "load|dp=2|e|2|mixtral", "load|dp=2 ep=2 zero=3|e|2|mixtral", "load|dp=2 ep=2|x|2|mixtral",
           "load|dp=2|f|2|mixtral", "load|dp=2 ep=2 zero=2|f|2|mixtral",  # ZeRO's shards and whole experts
           "load|dp=2 zero=1|a|2"]  # and under the plan it was saved with


# bf16-mixed: saved as the fp32 masters (ZeRO-1's sharded ones, ZeRO-3's pieces, a pipeline's
# two stages' masters of the tied embedding), then
# continued 2 steps (K+M) as the uninterrupted run; loaded under the same plan, another
# bf16 plan, an fp32 plan, and an fp32 checkpoint (a) loaded under bf16.
BF16 = "precision=bf16-mixed"
SAVES_BF16 = [f"save|dp=2 zero=1 {BF16}|m|3+2", f"save|dp=2 zero=3 {BF16} reduce_dtype=bf16|n|3+2",
              f"save|pp=2 mb=2 {BF16}|q|3+2"]  # q: the tied embedding and head on two ranks
LOADS_BF16 = [f"load|dp=2 zero=1 {BF16}|m|2", f"load|tp=2 {BF16}|m|2", f"load|pp=2 mb=2 {BF16}|m|2", "load|dp=2|m|2",
              f"load|dp=2 zero=3 {BF16} reduce_dtype=bf16|n|2", f"load|dp=2 zero=2 {BF16}|n|2",
              f"load|dp=2 zero=2 {BF16}|a|2", f"load|pp=2 mb=2 {BF16}|q|2", f"load|dp=2 zero=1 {BF16}|q|2"]


@pytest.fixture(scope="module")
def two_ranks(module_torchrun):
    ranks = module_torchrun("checkpoint_worker.py", 2, *SAVES_2, *LOADS_2, *SAVES_BF16, *LOADS_BF16,
                            "errors|dp=2|b", "faults|dp=2 zero=1|f")
    return ranks


@pytest.fixture(scope="module")
def four_ranks(two_ranks, module_torchrun):
    """World 4 loads world 2's checkpoint `a` (ZeRO-1) under tp + ZeRO-3, saves `c` under pp +
    ZeRO-1 (a tied embedding and head in two stages' flat layouts) and loads it under tp +
    ZeRO-2. (The same folder as `two_ranks`, whose per-rank results are read already.)"""
    jobs = ["load|dp=2 tp=2 zero=3|a|2", "save|dp=2 pp=2 zero=1 mb=2|c|3", "load|tp=2 dp=2 zero=2|c|2"]
    return module_torchrun("checkpoint_worker.py", 4, *jobs)


@pytest.fixture(scope="module")
def references():
    return {name: train_single_device(name) for name in ("gpt", "gpt2", "mixtral")}


def _assert_continues_uninterrupted(result: dict, reference: dict) -> None:
    """The 2 steps after the load are steps 4 and 5 of one device's uninterrupted run."""
    assert result["resumed"].step == 3 and result["resumed"].extra["next_batch"] == 3
    for step, (loss, expected) in enumerate(zip(result["losses"], reference["losses"][3:]), start=3):
        assert loss == pytest.approx(expected, rel=RELATIVE), f"loss of step {step}"
    state, ref_state = result["state"], reference["state"]
    assert set(state) == set(ref_state)
    difference = torch.cat([(state[k] - ref_state[k]).flatten() for k in ref_state])
    norm = torch.cat([v.flatten() for v in ref_state.values()])
    assert difference.norm() <= RELATIVE * norm.norm()
    assert_optimizer_state_equal(result["optimizer"], reference["optimizer"])


@pytest.mark.multirank
@pytest.mark.parametrize("job", LOADS_2)
def test_a_checkpoint_loads_under_another_plan_and_training_continues(two_ranks, references, job):
    model = job.split("|")[4] if job.count("|") == 4 else "gpt"
    saved_under = {"a": "dp=2 zero=1", "b": "tp=2", "g": "dp=2 zero=1", "z": "dp=2 zero=3",
                   "p": "cp=2", "e": "dp=2 ep=2", "x": "dp=2", "f": "dp=2 ep=2 zero=1"}[job.split("|")[2]]
    same_plan = job.split("|")[1] == saved_under
    for rank in two_ranks:
        _assert_continues_uninterrupted(rank[job], references[model])
        # Each rank's generators come back under the plan they were saved with (the worker
        # reseeded them after saving); under another plan they are left as they are.
        assert rank[job]["resumed"].rng_restored is same_plan
        saved_rng = rank[next(j for j in SAVES_2 if j.split("|")[2] == job.split("|")[2])]["rng"]
        assert torch.equal(rank[job]["rng"], saved_rng) is same_plan


@pytest.mark.multirank
@pytest.mark.parametrize("job", LOADS_BF16)
def test_bf16_mixed_checkpoints_hold_the_fp32_masters(two_ranks, job):
    """A bf16-mixed save holds the fp32 masters and their optimizer state, not the bf16
    working copies: any plan, bf16 or fp32, loads exactly the state that was saved (compared
    bitwise: no arithmetic happens between the two), and under the plan it was saved with the
    next steps are the uninterrupted run's, bitwise (the same plan runs the same arithmetic)."""
    name, plan = job.split("|")[2], job.split("|")[1]
    save = next(j for j in SAVES_2 + SAVES_BF16 if j.split("|")[2] == name)
    stored = read_checkpoint_metadata(two_ranks[0]["folder"] / name).state_dict_metadata
    assert stored["wte.weight"].properties.dtype == torch.float32  # the master's, saved by bf16 too
    for rank in two_ranks:
        saved, loaded = rank[save], rank[job]
        assert set(loaded["loaded"]) == set(saved["saved"])
        for key, value in saved["saved"].items():
            assert value.dtype == torch.float32 and torch.equal(loaded["loaded"][key], value), key
        for parameter, state in saved["saved_optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(loaded["loaded_optimizer"]["state"][parameter][key], value), (parameter, key)
        if plan == save.split("|")[1]:
            assert loaded["losses"] == saved["losses_after"]
            assert all(torch.equal(loaded["state"][k], v) for k, v in saved["state"].items())


@pytest.mark.multirank
def test_checkpoints_load_under_another_world_size(four_ranks, references):
    for rank in four_ranks:
        for job, result in rank.items():
            if job.startswith("load"):
                _assert_continues_uninterrupted(result, references["gpt"])


@pytest.mark.multirank
def test_every_rank_writes_its_own_shards(two_ranks):
    """Nothing is gathered: under tp=2 each rank's file holds its half (DCP's dedup writes the
    replicated biases once, by whichever rank has written less)."""
    folder = two_ranks[0]["folder"] / "b"
    files = sorted(folder.glob("*.distcp"))
    assert [f.name for f in files] == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [f.stat().st_size for f in files]
    assert max(sizes) < 0.7 * sum(sizes), sizes
    assert not any(p.name.endswith(".partial") for p in folder.parent.iterdir())
    manifest = json.loads((folder / "fxpar.json").read_text())
    assert manifest["plan"] == "tp=2" and manifest["step"] == 3 and manifest["optimizer"]["class"] == "AdamW"
    assert two_ranks[0]["save|tp=2|b|3"]["latest"] == folder


@pytest.mark.multirank
@pytest.mark.parametrize("name, steps", [("a", 3), ("b", 3)])
def test_save_full_loads_into_the_plain_model_and_its_optimizer(two_ranks, name, steps):
    """`save_full`'s safetensors file is `model.load_state_dict`'s, and its optimizer file is a
    plain AdamW's: one device continuing from them reaches the uninterrupted run's state."""
    folder = two_ranks[0]["folder"]
    model = build_model(seed=7)
    model.load_state_dict(load_file(folder / f"{name}.safetensors"))
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    optimizer.load_state_dict(load_full_optimizer_state(optimizer_path(folder / f"{name}.safetensors"), model))
    for tokens, labels in global_batches()[steps:]:
        model(tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = train_single_device()["state"]
    state = model.state_dict()
    difference = torch.cat([(state[k] - reference[k]).flatten() for k in reference])
    assert difference.norm() <= RELATIVE * torch.cat([v.flatten() for v in reference.values()]).norm()


@pytest.mark.multirank
def test_another_models_checkpoint_and_a_missing_one_are_clear_errors(two_ranks):
    messages = two_ranks[0]["errors|dp=2|b"]
    assert "has no tensor 'embed_tokens.weight', which this model has (and 20 more" in messages["llama"]
    assert "checkpoint of another model" in messages["llama"]
    assert "'wte.weight' of shape (64, 32) (torch.float32), but this model's is (64, 48)" in messages["wider"]
    assert "no checkpoint at" in messages["missing"] and "no-such-checkpoint" in messages["missing"]


@pytest.mark.multirank
def test_ranks_that_disagree_or_fail_leave_the_last_checkpoint_whole(two_ranks):
    """Each rank given its own folder (`rp_{rank}`: each would write half of a checkpoint no
    folder holds whole) and rank 1's disk full: every rank raises one CheckpointError naming
    the cause (not DCP's `CheckpointException ranks:dict_keys([0, 1])`), nothing is left
    claiming to be a checkpoint, and the last one loads as it was saved."""
    folder = two_ranks[0]["folder"]
    for rank in two_ranks:
        result = rank["faults|dp=2 zero=1|f"]
        assert result["messages"]["folders"] == (
            f"runner.save was given different folders on different ranks (rank 0: {folder / 'rp_0'}; rank 1: "
            f"{folder / 'rp_1'}): each rank would write its part of one checkpoint into another folder, and none "
            "would be complete. Nothing was written. Fix: pass every rank the same path (not one made from the "
            "rank), on a filesystem all ranks share")
        assert result["messages"]["disk full"].startswith(
            f"saving checkpoint {folder / 'f'} failed on rank 1: No space left on device (ENOSPC) writing "
            f"{folder / 'f.partial'}/__1_0.distcp. The checkpoint already at {folder / 'f'} is intact")
        assert not any(name.startswith("rp_") for name in result["listing"])
        assert result["step"] == 1 and result["intact"]


# -- resume after a crash -----------------------------------------------------------------------

def _train(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        str(TRAINER), "--plan", "dp=2 zero=1", "--steps", "6", "--batch", "4", "--seq", "32",
        "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--save-full", str(tmp_path / f"{name}.safetensors"),
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done


@pytest.mark.multirank
def test_a_rank_killed_mid_training_resumes_from_the_last_checkpoint(tmp_path):
    """Rank 1 SIGKILLs itself as step 3 starts; torchrun restarts both ranks, which load the
    step-2 checkpoint (skipping a folder a save never finished and a stale partial one) and
    train on: the final model and optimizer are the uninterrupted run's."""
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-00000099").mkdir(parents=True)  # a save that never completed
    (checkpoints / "step-00000099" / ".metadata").write_bytes(b"junk")
    (checkpoints / "step-00000002.partial").mkdir()  # an interrupted save of the same step
    (checkpoints / "step-00000002.partial" / "__7_0.distcp").write_bytes(b"junk")
    crashed = _train(tmp_path, "crashed", "--save-every", "2", "--resume", "auto",
                     "--checkpoint-dir", str(checkpoints), "--kill-rank-at", "1:3")
    assert "rank 1: killing myself at step 3" in crashed.stdout
    assert f"resumed from {checkpoints / 'step-00000002'} at step 2" in crashed.stdout
    assert not (checkpoints / "step-00000002" / "__7_0.distcp").exists()
    assert latest_checkpoint(checkpoints) == checkpoints / "step-00000006"
    _train(tmp_path, "uninterrupted")
    for suffix in (".safetensors", ".optimizer.safetensors"):
        crashed_state = load_file(tmp_path / f"crashed{suffix}")
        clean_state = load_file(tmp_path / f"uninterrupted{suffix}")
        assert set(crashed_state) == set(clean_state)
        for key, value in clean_state.items():
            assert torch.allclose(crashed_state[key], value, rtol=RELATIVE, atol=0), key
