"""Checkpoints that reshard: `runner.save(path)` and `runner.load(path)` with torch.distributed.checkpoint.

    runner.save("ckpt/step-00000100", optimizer=opt, step=100, extra={"data": position})
    ...                                   # later, any plan of the same model, any world size
    resumed = runner.load("ckpt/step-00000100", optimizer=opt)
    resumed.step, resumed.extra           # 100, {"data": position}

Every rank writes its own pieces of the parameters and of the optimizer state, under the
model's names and in global coordinates (`state`, `pieces`), so nothing
is gathered and a load under another plan (other dp, tp, pp, zero degrees, another world size)
reads, for each piece it holds now, the overlapping parts of what was written (`dcp_io`). The
folder holds DCP's files and `fxpar.json`: what was saved (plan, world size, optimizer class and
options, `step`, the caller's JSON `extra`, e.g. the data position; rank 0's, the same on every
rank when the loop is). `optimizer=` may be a list of optimizers over disjoint parameters
(Muon for the matrices, AdamW for the rest): their states share the keys' space, and a load
takes the same list.

A save writes into `<path>.partial` and renames it to `<path>` once DCP's metadata and the
manifest are on disk (`dcp_io.CommittingWriter`): a crash mid-save leaves `<path>` as it was,
and `latest_checkpoint` never picks a partial one.

What cannot go wrong silently:

- **Damage.** The manifest holds a hash (XXH3) of every saved item (a tensor's chunk) and each file's
  size (`checksums`); a load checks every byte it reads, so a flipped, truncated or
  deleted shard is a CheckpointError naming the file, the key and the byte offset. A
  checkpoint of format version 1 (before checksums) loads with a warning.
- **A damaged or edited manifest.** Every field is checked before use (`manifest`).
- **Ranks that disagree, two writers.** Before writing, the ranks agree on one folder and
  rank 0 locks `<path>.partial` for this job (`checkpoint_lock`).
- **Storage failures.** Disk full, permissions, I/O errors: one CheckpointError on every rank
  naming the first failing rank's cause, and saying the checkpoint at `path` is as it was
  (`checkpoint_failures`), which the commit scheme guarantees.
- **Optimizer state left behind.** `save` without `optimizer=` warns when an optimizer the
  runner made holds state, and `load` without it warns when the checkpoint holds some; an
  optimizer of another runner is an error (`checkpoint_optimizers`).

Random state: the random stream's seed and step (`fxpar.ops.random_streams`, what the graph's
dropout draws from) are in the manifest and always restored, so a resumed run draws the masks
the uninterrupted one would have (without them its step restarted at 0 and repeated the first
steps' masks). Each rank's torch generators (`rng.<rank>.*`, what the model's own code draws
from outside the graph) are restored when the plan is the checkpoint's (a rank's draws follow
its place in the mesh); under another plan they are left as they are and
`Resumed.rng_restored` is False.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fxpar.errors import CheckpointError
from fxpar.ir import meta
from fxpar.runtime.checkpoint.checksums import check_files_present, verify_file
from fxpar.runtime.checkpoint.dcp_io import (
    CommittingWriter,
    PiecesLoadPlanner,
    PiecesSavePlanner,
    SafeReader,
    read_checkpoint_metadata,
    stored_tensors,
)
from fxpar.runtime.checkpoint.failures import checkpoint_failure
from fxpar.runtime.checkpoint.lock import claim_folder, release_lock
from fxpar.runtime.checkpoint.manifest import (
    FORMAT,
    METADATA_FILE,
    PARTIAL_SUFFIX,
    VERSION,
    read_manifest,
    warn_unverified,
)
from fxpar.runtime.checkpoint.optimizers import warn_unread
from fxpar.runtime.checkpoint.state import (
    OPTIMIZER_PREFIX,
    RNG_PREFIX,
    RankState,
    model_tensors,
    optimizer_tensors,
    rng_tensors,
)
from fxpar.runtime.state.wrapped_optimizer import inner_optimizer


@dataclass(frozen=True)
class Resumed:
    """What `runner.load` read besides the tensors."""

    step: int | None
    extra: Any  # the caller's JSON value, as given to save
    plan: str  # the plan the checkpoint was saved under
    world_size: int
    rng_restored: bool


def save(state: RankState, path: str | Path, *, optimizer=None, step: int | None = None, extra: Any = None) -> None:
    """Write this rank's pieces to checkpoint folder `path` (module doc); every rank calls it."""
    path = Path(path)
    program = state.program
    manifest = {
        "format": FORMAT, "version": VERSION, "plan": str(program.plan), "world_size": program.world_size,
        "step": step, "extra": extra, "optimizer": _optimizer_manifest(optimizer),
        "random": state.random.state() if state.random is not None else None,
    }
    try:
        json.dumps(manifest, allow_nan=False)  # what CommittingWriter writes, with the checksums
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"runner.save(extra=...) must be JSON (numbers, strings, lists, dicts; no NaN): {error}. "
            "Fix: pass the data position as plain values"
        ) from None
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise CheckpointError(f"runner.save(step={step!r}): step must be an int or None")
    tensors, _ = model_tensors(state, writing=True)
    for each in listed(optimizer):
        held = optimizer_tensors(each, state)[0]
        if clash := sorted(held.keys() & tensors.keys()):
            raise CheckpointError(f"two of the optimizers given hold {clash[0]!r}: each parameter is stepped by "
                                  "one optimizer. Fix: pass optimizers over disjoint parameters")
        tensors |= held
    tensors |= rng_tensors(state, loading=False)[0]
    staging = path.with_name(path.name + PARTIAL_SUFFIX)
    existed = (path / METADATA_FILE).is_file()
    lock = claim_folder(path, staging)  # one folder on every rank, one job writing it
    try:
        dcp.save(tensors, storage_writer=CommittingWriter(staging, path, manifest, lock), planner=PiecesSavePlanner())
    except (Exception, CheckpointException) as error:  # DCP's gathered failures are a BaseException
        if lock is not None:
            release_lock(staging, lock)
        failure, cause = checkpoint_failure(error, action="save", path=path, existed=existed)
        raise failure from cause


def load(state: RankState, path: str | Path, *, optimizer=None) -> Resumed:
    """Read checkpoint folder `path` into this rank's parameters (and `optimizer`'s state),
    whatever plan wrote it; every rank calls it. Raises CheckpointError, naming the key, for
    a checkpoint of another model, and for a missing or incomplete folder."""
    path = Path(path)
    manifest = read_manifest(path)
    checksums = manifest["checksums"]
    if checksums is None:
        warn_unverified(path, manifest)
    else:  # on every rank, before DCP's first collective and before .metadata is unpickled
        check_files_present(path, checksums)
        verify_file(path, METADATA_FILE, checksums)
    stored = stored_tensors(read_checkpoint_metadata(path))
    check_same_model(state, stored, path, manifest)
    tensors, finish_model = model_tensors(state, writing=False)
    saved_optimizers = _saved_optimizers(optimizer, manifest, path)
    finishes = []
    for each, saved in zip(listed(optimizer), saved_optimizers):
        _check_optimizer(each, saved, path)
        optimizer_state, finish = optimizer_tensors(each, state, stored=stored)
        tensors |= optimizer_state
        finishes.append(finish)
    same_plan = manifest["plan"] == str(state.program.plan) and manifest["world_size"] == state.program.world_size
    rng, restore_rng = rng_tensors(state, loading=True)
    rng_restored = same_plan and all(key in stored and tuple(stored[key].size) == t.shape for key, t in rng.items())
    if rng_restored:
        tensors |= rng
    if optimizer is None:
        warn_unread(manifest, stored, path, prefix=OPTIMIZER_PREFIX)
    try:
        dcp.load(tensors, storage_reader=SafeReader(path, checksums), planner=PiecesLoadPlanner())
    except (Exception, CheckpointException) as error:
        failure, cause = checkpoint_failure(error, action="load", path=path)
        raise failure from cause
    finish_model()
    for each, saved, finish in zip(listed(optimizer), saved_optimizers, finishes):
        finish()
        _restore_options(each, saved["param_groups"])
    if rng_restored:
        restore_rng()
    if manifest["random"] is not None and state.random is not None:
        state.random.load_state(manifest["random"])
    return Resumed(step=manifest["step"], extra=manifest["extra"], plan=manifest["plan"],
                   world_size=manifest["world_size"], rng_restored=rng_restored)


def verify_checkpoint(folder: str | Path) -> None:
    """Re-read every file of checkpoint `folder` and check each item's hash against its
    manifest (one process, no collectives); a CheckpointError names the first damage. A load
    checks only what it reads."""
    folder = Path(folder)
    checksums = read_manifest(folder)["checksums"]
    if checksums is None:
        raise CheckpointError(f"checkpoint {folder} was saved without checksums (format version 1): there is "
                              "nothing to verify it against. Fix: save it again with this fxpar")
    check_files_present(folder, checksums)
    for name in checksums["files"]:
        verify_file(folder, name, checksums)


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The complete checkpoint in `folder` with the highest step (then the newest), or None:
    folders a save did not finish (`.partial`) and anything without a readable manifest are
    skipped (what `examples/train_gpt.py --resume auto` loads)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = []
    for candidate in folder.iterdir():
        if not candidate.is_dir() or candidate.name.endswith((PARTIAL_SUFFIX, ".old")):
            continue
        try:
            manifest = read_manifest(candidate)
        except CheckpointError:
            continue
        step = manifest.get("step")
        found.append((step if isinstance(step, int) else -1, candidate.stat().st_mtime, candidate))
    return max(found, key=lambda f: f[:2])[2] if found else None


def check_same_model(state: RankState, stored: dict, path: Path, manifest: dict) -> None:
    """The checkpoint's model tensors are this model's: the same keys, shapes and dtypes; its
    optimizer state names only this model's parameters. Otherwise a CheckpointError that
    names the keys."""
    captured = state.program.captured.graph_module
    aliases = meta.graph_aliases(captured)
    expected = {k: v for k, v in captured.state_dict().items() if k not in aliases}
    saved = {k: e for k, e in stored.items() if not k.startswith((OPTIMIZER_PREFIX, RNG_PREFIX))}
    where = f"checkpoint {path} (saved under plan '{manifest['plan']}')"
    missing = [k for k in expected if k not in saved]
    if missing:
        raise CheckpointError(f"{where} has no tensor {missing[0]!r}, which this model has{_more(missing)}; "
                              "it is a checkpoint of another model. Fix: load it into the model it was saved from")
    extra = [k for k in saved if k not in expected]
    if extra:
        raise CheckpointError(f"{where} has a tensor {extra[0]!r} that this model does not have{_more(extra)}; "
                              "it is a checkpoint of another model. Fix: load it into the model it was saved from")
    for key, tensor in expected.items():
        entry, dtype = saved[key], state.dtypes[key]
        if tuple(entry.size) != tuple(tensor.shape) or entry.properties.dtype != dtype:
            raise CheckpointError(
                f"{where} has {key!r} of shape {tuple(entry.size)} ({entry.properties.dtype}), but this model's "
                f"is {tuple(tensor.shape)} ({dtype}). Fix: load it into the model it was saved from"
            )
    parameters = {k for k in expected if k in dict(captured.named_parameters())}
    for key, entry in stored.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name = key[len(OPTIMIZER_PREFIX):].rpartition(".")[0]
            if name not in parameters:
                raise CheckpointError(f"{where} has optimizer state {key!r} of {name!r}, not a parameter of this "
                                      "model. Fix: load it into the model it was saved from")
            if len(entry.size) and tuple(entry.size) != tuple(expected[name].shape):
                raise CheckpointError(f"{where} has {key!r} of shape {tuple(entry.size)}, not its parameter's "
                                      f"{tuple(expected[name].shape)}")


def listed(optimizer) -> list:
    """`runner.save`/`load`'s `optimizer=`: none, one, or a list of optimizers over disjoint
    parameters (Muon for the matrices, AdamW for the rest), as a list."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def _optimizer_manifest(optimizer) -> dict | list | None:
    """The class and group options of `optimizer` (of each, for a list), as JSON."""
    if isinstance(optimizer, (list, tuple)):
        return [_optimizer_manifest(each) for each in optimizer]
    if optimizer is None:
        return None
    inner = inner_optimizer(optimizer)
    groups = [{k: _json_option(v) for k, v in g.items() if k != "params" and _json_option(v) is not _SKIP}
              for g in inner.param_groups]
    return {"class": type(inner).__name__, "param_groups": groups}


_SKIP = object()


def _json_option(value):
    """An optimizer option as JSON (tuples as lists), or _SKIP for one that is not plain data."""
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, (list, tuple)) and all(_json_option(v) is not _SKIP for v in value):
        return [_json_option(v) for v in value]
    return _SKIP


def _saved_optimizers(optimizer, manifest: dict, path: Path) -> list[dict]:
    """The manifest's entry of each optimizer `load` was given, in order: one for one, a list
    of as many for a list."""
    if not listed(optimizer):  # none, or `[]`: the model alone, on purpose
        return []
    saved = manifest.get("optimizer")
    if saved is None:
        raise CheckpointError(f"checkpoint {path} has no optimizer state (saved without optimizer=). "
                              "Fix: load without optimizer=, or save with it")
    given = listed(optimizer)
    saved_list = saved if isinstance(saved, list) else [saved]
    if isinstance(optimizer, (list, tuple)) != isinstance(saved, list) or len(saved_list) != len(given):
        raise CheckpointError(f"checkpoint {path} holds the state of {len(saved_list)} optimizer(s) "
                              f"({', '.join(s['class'] for s in saved_list)}); load was given {len(given)}. "
                              "Fix: pass the optimizers it was saved with, in the same order")
    return saved_list


def _check_optimizer(optimizer, saved: dict, path: Path) -> None:
    inner = inner_optimizer(optimizer)
    if saved["class"] != type(inner).__name__:
        raise CheckpointError(f"checkpoint {path} holds {saved['class']} state; this optimizer is "
                              f"{type(inner).__name__}. Fix: make the optimizer the checkpoint was saved with")
    if len(saved["param_groups"]) != len(inner.param_groups):
        raise CheckpointError(f"checkpoint {path} has {len(saved['param_groups'])} optimizer parameter groups; "
                              f"this optimizer has {len(inner.param_groups)}")


def _restore_options(optimizer, saved_groups: list[dict]) -> None:
    """The saved options (lr, betas, ...) back into the optimizer's groups, typed as they are,
    as `torch.optim.Optimizer.load_state_dict` restores its groups: a key the group lacks comes
    back too (a scheduler's `initial_lr`, which one made after the load to resume reads)."""
    inner = inner_optimizer(optimizer)
    for group, saved in zip(inner.param_groups, saved_groups):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more: {', '.join(map(repr, keys[1:4]))}{', ...' if len(keys) > 4 else ''})" \
        if len(keys) > 1 else ""

