"""Checkpoints that cannot lie (`runtime.checkpoint.save_load`'s list): damage, a bad manifest, a second
writer, a full disk and optimizer state left behind are each a clear error or warning.

Single-process: the small GPT bound in a world of one (real DCP, real collectives of one
rank), one AdamW step, saved once per module into `saved`; each test damages a copy. The
two-rank cases (ranks given different folders, a disk full on one rank) run in
test_checkpoint.py's launch (`test_ranks_that_disagree_or_fail_leave_the_last_checkpoint_whole`).
"""

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import xxhash

import fxpar
from fxpar.errors import CheckpointError
from fxpar.runtime.checkpoint.checksums import ChecksummingFileSystem
from fxpar.runtime.checkpoint.lock import LOCK_FILE, Holder, take_lock
from fxpar.runtime.checkpoint.manifest import validate_manifest
from fxpar.runtime.checkpoint.save_load import verify_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1]))
from small_gpt import small_capture  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

TOKENS = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def bound(tmp_path_factory):
    """A runner of the small GPT in a world of one, its AdamW stepped once, and `saved`: the
    checkpoint of that state, with the state itself."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        program = fxpar.compile(small_capture(), "dp=1")
        runner = program.bind(timeout=10)
        optimizer = runner.optimizer(torch.optim.AdamW, lr=1e-2)
        runner.step(TOKENS, TOKENS)
        optimizer.step()
        saved = tmp_path_factory.mktemp("checkpoints") / "saved"
        runner.save(saved, optimizer=optimizer, step=1)
        yield {"runner": runner, "optimizer": optimizer, "program": program, "saved": saved,
               "state": runner.full_state_dict(), "moments": _moments(optimizer)}
        runner.close()


def _moments(optimizer) -> dict:
    return {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}


def _copy(bound, tmp_path) -> Path:
    return Path(shutil.copytree(bound["saved"], tmp_path / "copy"))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "fxpar.json").read_text())


def _item(folder: Path, key: str) -> tuple[str, dict]:
    files = _manifest(folder)["checksums"]["files"]
    return next((name, item) for name, entry in files.items() for item in entry["items"] if item["key"] == key)


def _load(bound, folder: Path):
    return bound["runner"].load(folder, optimizer=bound["optimizer"])


# -- checksums ---------------------------------------------------------------------------------


def test_the_manifest_holds_a_hash_of_every_byte_saved(bound):
    """Each file's items tile it from byte 0 to its size, each item's hash is that of its bytes
    (computed here from the file, apart from how the save computed it as it wrote), and the
    saved keys are the model's, its AdamW state's and the generators'."""
    folder = bound["saved"]
    files = _manifest(folder)["checksums"]["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    keys = set()
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert len(data) == entry["size"] == sum(item["length"] for item in entry["items"])
        for item in entry["items"]:
            stored = data[item["offset"]: item["offset"] + item["length"]]
            assert xxhash.xxh3_64_hexdigest(stored) == item["hash"], item["key"]
            keys.add(item["key"])
    assert {"wte.weight", "optim.state.wte.weight.exp_avg", "optim.state.wte.weight.step", "rng.0.cpu"} <= keys
    verify_checkpoint(folder)


@pytest.mark.parametrize("key", ["h.1.mlp.up.weight", "optim.state.h.1.mlp.up.weight.exp_avg_sq"])
def test_flipped_bytes_in_a_shard_name_the_file_key_and_offset(bound, tmp_path, key):
    """64 bytes flipped in the middle of a weight's, or of its Adam moment's, stored bytes:
    the load stops before torch.load reads them (these loaded as ~2e37 before)."""
    folder = _copy(bound, tmp_path)
    name, item = _item(folder, key)
    with open(folder / name, "r+b") as file:
        file.seek(item["offset"] + item["length"] // 2)
        data = file.read(64)
        file.seek(-64, os.SEEK_CUR)
        file.write(bytes(b ^ 0xFF for b in data))
    message = re.escape(f"checkpoint file {folder / name}: the {item['length']:,} bytes at byte offset "
                        f"{item['offset']:,}, which hold {key!r}")
    with pytest.raises(CheckpointError, match=message + ".*damaged after it was written"):
        _load(bound, folder)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(folder)


def test_a_truncated_a_deleted_shard_and_damaged_metadata_are_named(bound, tmp_path):
    folder = _copy(bound, tmp_path)
    shard = folder / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as file:
        file.truncate(size - 100)
    name, last = _item(folder, "rng.0.cpu")  # written last
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint file {shard} is {size - 100:,} bytes, but its save wrote {size:,} (fxpar.json): it is "
            f"truncated; the first item it cuts is 'rng.0.cpu' (its chunk at (0,)) at byte offset {last['offset']:,}")):
        _load(bound, folder)
    shard.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {folder} lacks __0_0.distcp, which its save "
                                                        f"wrote ({size:,} bytes holding ")):
        _load(bound, folder)
    metadata = Path(shutil.copytree(bound["saved"], tmp_path / "other")) / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in DCP's pickle: checked before it is unpickled
    metadata.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {metadata}: the {len(data):,} bytes at "
                                                        "byte offset 0, which hold '.metadata', hash to xxh3_64")):
        _load(bound, metadata.parent)


def test_a_checkpoint_without_checksums_loads_with_a_warning(bound, tmp_path):
    """Format version 1 (before checksums) still loads, every tensor as saved."""
    folder = _copy(bound, tmp_path)
    manifest = _manifest(folder)
    del manifest["checksums"]
    (folder / "fxpar.json").write_text(json.dumps(manifest | {"version": 1}))
    runner, optimizer = bound["runner"], bound["optimizer"]
    runner.step(TOKENS, TOKENS)  # moves the state away from the checkpoint's
    optimizer.step()
    optimizer.zero_grad()
    with pytest.warns(UserWarning, match="format version 1\\) has no checksums.*loaded unverified"):
        assert runner.load(folder, optimizer=optimizer).step == 1
    assert all(torch.equal(runner.full_state_dict()[k], v) for k, v in bound["state"].items())
    assert all(torch.equal(_moments(optimizer)[i][k], v) for i, s in bound["moments"].items() for k, v in s.items())


# -- the manifest ------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, expected", [
    ("step", "two", "field 'step' is 'two', expected a non-negative int or null"),
    ("step", -3, "field 'step' is -3, expected a non-negative int or null"),
    ("world_size", -1, "field 'world_size' is -1, expected a positive int (the number of ranks that saved it)"),
    ("world_size", True, "field 'world_size' is True, expected a positive int"),
    ("world_size", 2, "field 'world_size' is 2, but its plan 'dp=1' runs on 1 ranks"),
    ("plan", ["dp=1"], "field 'plan' is ['dp=1'], expected a plan's text form"),
    ("plan", "dp=2 zero=9", "field 'plan' is 'dp=2 zero=9', expected a plan's text form"),
    ("version", 7, "field 'version' is 7; this fxpar reads checkpoint format versions 1, 2"),
    ("optimizer", "AdamW", "field 'optimizer' is 'AdamW', expected null, or {'class': name"),
    ("checksums", {"algorithm": "md5", "files": {}}, "field 'checksums' is {'algorithm': 'md5', 'files': {}}, "
                                                     "expected {'algorithm': 'xxh3_64'"),
    ("random", {"seed": 1, "step": -2}, "field 'random' is {'seed': 1, 'step': -2}, expected null or {'seed'"),
])
def test_every_manifest_field_is_checked_before_use(bound, field, value, expected):
    manifest = _manifest(bound["saved"])
    with pytest.raises(CheckpointError) as caught:
        validate_manifest(manifest | {field: value}, Path("ck/fxpar.json"))
    assert str(caught.value).startswith(f"ck/fxpar.json: {expected}")
    assert "Fix: " in str(caught.value)


def test_item_checksums_that_do_not_tile_their_file_are_refused(bound):
    manifest = _manifest(bound["saved"])
    items = manifest["checksums"]["files"]["__0_0.distcp"]["items"]
    items[1]["offset"] += 1
    with pytest.raises(CheckpointError, match=re.escape(
            "field \"checksums.files['__0_0.distcp'].items[1]\" is") + ".*items tile the file in order"):
        validate_manifest(manifest, Path("fxpar.json"))


# -- one writer --------------------------------------------------------------------------------


def test_a_folder_another_live_job_is_saving_to_is_refused(bound, tmp_path):
    """A lock held by a running process of another job (pid 1 always runs): runner.save
    names that job and commits nothing; the checkpoint already there is untouched."""
    folder = _copy(bound, tmp_path)
    staging = folder.with_name(folder.name + ".partial")
    staging.mkdir()
    other = Holder(job="job-7f3a", host=socket.gethostname(), pid=1, time=time.time())
    (staging / LOCK_FILE).write_text(json.dumps(other.__dict__))
    before = (folder / "__0_0.distcp").read_bytes()
    with pytest.raises(CheckpointError, match=re.escape(f"{staging} is being written by another job 'job-7f3a' "
                                                        f"(host {socket.gethostname()}, pid 1, since")):
        bound["runner"].save(folder, optimizer=bound["optimizer"], step=2)
    assert (folder / "__0_0.distcp").read_bytes() == before and _manifest(folder)["step"] == 1
    assert json.loads((staging / LOCK_FILE).read_text())["job"] == "job-7f3a"  # still theirs


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"job": "job-dead", "host": socket.gethostname(), "pid": gone.pid,
                                "time": time.time()}))
    with pytest.warns(UserWarning, match="taking over the stale lock of job 'job-dead'"):
        mine = take_lock(tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid() == mine.pid
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # this job's own lock (a save that did not finish): silently
        take_lock(tmp_path)


# -- storage failures --------------------------------------------------------------------------


class _FullDisk:
    """A file whose writes fail with `code` once `room` bytes are written."""

    def __init__(self, path: Path, mode: str, code: int, room: int) -> None:
        self.file, self.code, self.room = path.open(mode), code, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


@pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "Fix: free space on that filesystem"),
                                       (errno.EIO, "Fix: check the storage device")])
def test_a_failed_write_names_its_cause_and_leaves_the_last_checkpoint_whole(bound, tmp_path, monkeypatch, code, fix):
    folder = _copy(bound, tmp_path)
    monkeypatch.setattr(ChecksummingFileSystem, "open_for_writing",
                        lambda self, path, mode: _FullDisk(path, mode, code, room=100_000))
    runner, optimizer = bound["runner"], bound["optimizer"]
    with pytest.raises(CheckpointError) as caught:
        runner.save(folder, optimizer=optimizer, step=2)
    message = str(caught.value)
    assert message.startswith(f"saving checkpoint {folder} failed on rank 0: {os.strerror(code)} "
                              f"({errno.errorcode[code]}) writing {folder}.partial/__0_0.distcp. The checkpoint "
                              f"already at {folder} is intact"), message
    assert fix in message and "CheckpointException" not in message
    monkeypatch.undo()
    runner.step(TOKENS, TOKENS)
    optimizer.step()
    optimizer.zero_grad()
    assert runner.load(folder, optimizer=optimizer).step == 1  # the last checkpoint, whole
    assert all(torch.equal(runner.full_state_dict()[k], v) for k, v in bound["state"].items())
    runner.save(folder, optimizer=optimizer, step=1)  # the failed save released its lock
    assert not (folder / LOCK_FILE).exists() and not folder.with_name("copy.partial").exists()


def test_a_failed_read_names_its_cause(bound, tmp_path, monkeypatch):
    folder = _copy(bound, tmp_path)

    def failing_read(self, file, sinfo):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(folder / sinfo.relative_path))

    monkeypatch.setattr("fxpar.runtime.checkpoint.dcp_io.SafeReader._slice_file", failing_read)
    with pytest.raises(CheckpointError, match=re.escape(
            f"loading checkpoint {folder} failed on rank 0: Input/output error (EIO) at {folder}/__0_0.distcp. "
            "The model and optimizer may be partly loaded: load again before training. Fix: check the storage")):
        _load(bound, folder)


# -- the random stream ----------------------------------------------------------------------------


def test_a_resumed_run_draws_the_dropout_masks_the_uninterrupted_one_draws(bound, tmp_path):
    """Dropout's masks come from the random stream's seed and step (`fxpar.ops.random_streams`),
    which the manifest carries: a step after a load draws what the same step drew before it.
    Before, the stream kept counting, so the repeated step drew another mask (and a restarted
    job began again at step 0, repeating the first steps' masks)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.5))
    inputs = (TOKENS, TOKENS.roll(-1, dims=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = fxpar.compile(model, "dp=1", example_inputs=inputs)
    # A world of one beside `bound`'s runner (closing either would end both: `bound` does)
    runner = program.bind(timeout=10)
    runner.step(*inputs)
    runner.save(tmp_path / "after_one", optimizer=[])
    position = runner.rng_state()
    uninterrupted = runner.step(*inputs)
    assert runner.rng_state()["step"] == position["step"] + 1
    runner.load(tmp_path / "after_one")
    assert runner.rng_state() == position
    assert runner.step(*inputs) == uninterrupted  # the same masks: the same loss, bit for bit


# -- optimizer state never dropped silently -----------------------------------------------------


def test_optimizer_state_left_out_of_a_save_or_a_load_is_said(bound, tmp_path):
    runner = bound["runner"]
    with pytest.warns(UserWarning, match=r"runner.save\('.*model-only'\) leaves out the state of AdamW \(108 state "
                                         r"tensors over 36 parameters or shards\).*Fix: pass optimizer=opt"):
        runner.save(tmp_path / "model-only", step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.save(tmp_path / "on-purpose", optimizer=[], step=1)  # the model alone, said so
        runner.load(tmp_path / "on-purpose")
        runner.load(tmp_path / "model-only")
    with pytest.warns(UserWarning, match=r"runner.load\('.*saved'\) without optimizer= did not restore the "
                                         r"checkpoint's optimizer state \(AdamW: 108 tensors, 'optim.state.\*'\)"):
        runner.load(bound["saved"])


def test_an_optimizer_of_another_runner_is_refused(bound, tmp_path):
    """A rebind of the same program (after close) gets a new runner; the old runner's optimizer
    steps tensors the new one may no longer use (ZeRO shards, fp32 masters)."""
    old_runner, old_optimizer = bound["runner"], bound["optimizer"]
    old_runner.close()
    with pytest.MonkeyPatch.context() as patch:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            patch.setenv("MASTER_PORT", str(probe.getsockname()[1]))
        runner = bound["program"].bind(timeout=10)
        try:
            for action in ("save", "load"):
                with pytest.raises(CheckpointError, match=re.escape(
                        f"runner.{action}(optimizer=...) was given an optimizer (AdamW) that the runner of plan 'dp=1' (rank 0) "
                        "made, not this runner (plan 'dp=1', rank 0)")):
                    getattr(runner, action)(bound["saved"] if action == "load" else tmp_path / "x",
                                            optimizer=[old_optimizer])
        finally:
            runner.close()
