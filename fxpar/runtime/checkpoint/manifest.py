"""`fxpar.json`, a checkpoint's manifest: what was saved, and the checksums of its bytes.

    {"format": "fxpar-checkpoint", "version": 2,
     "plan": "dp=2 zero=1", "world_size": 2,      # the plan and world that saved it
     "step": 100, "extra": {"data": 4096},          # the caller's step (or null) and JSON value
     "random": {"seed": 1234, "step": 100},          # the random stream's (`fxpar.ops.random_streams`)
     "optimizer": {"class": "AdamW", "param_groups": [{"lr": 0.001, ...}]},   # or a list, or null
     "checksums": {"algorithm": "xxh3_64", "files": {...}}}                     # `checksums`

The manifest is read as untrusted input, as a plan file is: `read_manifest` checks every field's
type and range (`validate_manifest`) and names the field, the value it holds (80 characters at
most, `errors.shown`) and what it must be, before a load uses any of it. Version 1 (before
checksums) still loads, unverified, with a warning.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from fxpar.errors import CheckpointError, PlanError, shown
from fxpar.runtime.checkpoint.checksums import ALGORITHM

FORMAT = "fxpar-checkpoint"
VERSION = 2  # 2: checksums; 1: none
READABLE_VERSIONS = (1, 2)
PARTIAL_SUFFIX = ".partial"
MANIFEST_FILE = "fxpar.json"  # fxpar's: what the checkpoint is, written last (`dcp_io.CommittingWriter`)
METADATA_FILE = ".metadata"  # DCP's
_FIX = "Fix: the manifest was edited or damaged: restore it from a copy, or load another checkpoint"


def read_manifest(path: Path) -> dict:
    """`path`'s fxpar.json, after checking the folder is a complete fxpar checkpoint and every
    field of the manifest is well formed."""
    if not path.exists():
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        hint = (f" ({partial} is a save that did not finish)" if partial.exists()
                else f"; checkpoints in {path.parent}: {_listing(path.parent)}" if path.parent.is_dir() else "")
        raise CheckpointError(f"no checkpoint at {path}{hint}. Fix: pass a folder runner.save wrote "
                              "(latest_checkpoint(folder) finds the newest)")
    if not (path / MANIFEST_FILE).is_file() or not (path / METADATA_FILE).is_file():
        raise CheckpointError(
            f"{path} is not a complete fxpar checkpoint: it lacks {MANIFEST_FILE} or DCP's {METADATA_FILE} "
            "(runner.save writes both, then renames the folder into place). Fix: pass a folder runner.save wrote"
        )
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path / MANIFEST_FILE} is not valid JSON: {error}. {_FIX}") from None
    return validate_manifest(manifest, path / MANIFEST_FILE)


def validate_manifest(manifest: object, file: Path) -> dict:
    """`manifest` if each field has its type and range, else a CheckpointError naming `file`,
    the field, its value and the expectation."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{file} is not an fxpar checkpoint manifest: field 'format' is {shown(found)}, "
                              f"expected {FORMAT!r}. Fix: pass a folder runner.save wrote")
    version = manifest.get("version")
    if not _is_int(version) or version not in READABLE_VERSIONS:
        raise CheckpointError(f"{file}: field 'version' is {shown(version)}; this fxpar reads checkpoint format "
                              f"versions {', '.join(map(str, READABLE_VERSIONS))}. Fix: load it with the fxpar that saved it")
    _check(file, manifest, "world_size", _is_int(manifest.get("world_size")) and manifest["world_size"] > 0,
           "a positive int (the number of ranks that saved it)")
    step = manifest.get("step")
    _check(file, manifest, "step", step is None or (_is_int(step) and step >= 0), "a non-negative int or null")
    random = manifest.setdefault("random", None)  # absent from checkpoints saved before it
    _check(file, manifest, "random", random is None or (
        isinstance(random, dict) and set(random) == {"seed", "step"} and all(map(_is_size, random.values()))),
        "null or {'seed': int >= 0, 'step': int >= 0} (the random stream's position)")
    _check_plan(file, manifest)
    _check_optimizer(file, manifest)
    if version >= 2:
        _check_checksums(file, manifest)
    else:
        manifest.setdefault("checksums", None)
    return manifest


def warn_unverified(path: Path, manifest: dict) -> None:
    """A version-1 checkpoint loads without checksums: say so."""
    if manifest["checksums"] is None:
        warnings.warn(f"fxpar: checkpoint {path} (format version 1) has no checksums, so damage to its files "
                      "cannot be detected; it is loaded unverified. Fix: save it again with this fxpar",
                      stacklevel=4)


def _check_plan(file: Path, manifest: dict) -> None:
    from fxpar.plan.file import FILE_SUFFIXES
    from fxpar.plan.plan import Plan

    text = manifest.get("plan")
    expectation = "a plan's text form, such as 'dp=2 zero=1'"
    _check(file, manifest, "plan", isinstance(text, str) and "/" not in text
           and not text.strip().lower().endswith(FILE_SUFFIXES), expectation)  # text, never a path to read
    try:
        plan = Plan.parse(text)
    except PlanError as error:
        raise CheckpointError(f"{file}: field 'plan' is {shown(text)}, expected {expectation}: {error}. {_FIX}") from None
    if plan.world_size != manifest["world_size"]:
        raise CheckpointError(f"{file}: field 'world_size' is {manifest['world_size']}, but its plan {text!r} runs on "
                              f"{plan.world_size} ranks. {_FIX}")


def _check_optimizer(file: Path, manifest: dict) -> None:
    saved = manifest.get("optimizer")
    for index, each in enumerate(saved if isinstance(saved, list) else [] if saved is None else [saved]):
        where = "optimizer" if not isinstance(saved, list) else f"optimizer[{index}]"
        groups = each.get("param_groups") if isinstance(each, dict) else None
        ok = (isinstance(each, dict) and isinstance(each.get("class"), str) and isinstance(groups, list)
              and all(isinstance(g, dict) for g in groups))
        _check(file, manifest, where, ok, "null, or {'class': name, 'param_groups': [options, ...]}, or a list "
               "of those", value=each)


def _check_checksums(file: Path, manifest: dict) -> None:
    checksums = manifest.get("checksums")
    files = checksums.get("files") if isinstance(checksums, dict) else None
    _check(file, manifest, "checksums", isinstance(files, dict) and checksums.get("algorithm") == ALGORITHM,
           f"{{'algorithm': {ALGORITHM!r}, 'files': {{name: {{'size': bytes, 'items': [...]}}}}}}")
    for name, entry in files.items():
        where = f"checksums.files[{name!r}]"
        ok = ("/" not in name and name not in ("", ".", "..") and isinstance(entry, dict)
              and _is_size(entry.get("size")) and isinstance(entry.get("items"), list))
        _check(file, manifest, where, ok, "a file name in the folder with {'size': bytes, 'items': [...]}",
               value=entry)
        end = 0  # items follow one another from byte 0 to the end of the file
        for index, item in enumerate(entry["items"]):
            ok = (isinstance(item, dict) and isinstance(item.get("key"), str) and isinstance(item.get("chunk"), list)
                  and all(_is_size(o) for o in item["chunk"]) and item.get("offset") == end
                  and _is_size(item.get("length")) and _is_hash(item.get("hash")))
            _check(file, manifest, f"{where}.items[{index}]", ok, f"{{'key', 'chunk', 'offset': {end}, 'length', "
                   "'hash': 16 hex digits}: items tile the file in order", value=item)
            end += item["length"]
        if end != entry["size"]:
            raise CheckpointError(f"{file}: the items of {where} end at byte {end:,}, but the file's size is "
                                  f"{entry['size']:,}: some of its bytes would go unchecked. {_FIX}")


def _check(file: Path, manifest: dict, field: str, ok: bool, expectation: str, *, value: object = None) -> None:
    if not ok:
        found = manifest.get(field) if value is None else value
        raise CheckpointError(f"{file}: field {field!r} is {shown(found)}, expected {expectation}. {_FIX}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size(value: object) -> bool:
    return _is_int(value) and value >= 0


def _is_hash(value: object) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir() if p.is_dir())[:5]
    return ", ".join(names) if names else "none"
