"""fxpar's pieces through torch.distributed.checkpoint: planners, a committing writer, a safe reader.

DCP plans a save in three steps: every rank lists what it will write (`create_local_plan`),
the coordinator (rank 0) removes duplicates (a replicated chunk is written once) and checks
that each tensor's chunks tile it exactly (`DefaultSavePlanner`'s global plan), then every
rank writes its own files and the coordinator writes `.metadata`. The planners here speak in
`pieces.GlobalTensor`s: each piece is one chunk, at its global offsets, read from or
written into a view of the live tensor. A load asks DCP, for each piece this rank holds now,
for the parts of the saved chunks it overlaps (`create_read_items_for_chunk_list`), which is
what makes a checkpoint of one plan load under another.

Nothing of fxpar's is pickled. The tensors' files are read with `torch.load(weights_only=True)`
by DCP; its `.metadata` file is a pickle, which `read_checkpoint_metadata` unpickles with an
allow-list of DCP's own metadata classes (anything else is refused, naming it), and a
checkpoint entry stored as pickled bytes is refused rather than loaded (`load_bytes`).

DCP's own coordination (gathering the plans, broadcasting the metadata) is a handful of
object collectives on the default process group, which carries bind's finite timeout; they
are the library's, outside fxpar's step programs, and happen only in `save`/`load`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fxpar.errors import CheckpointError
from fxpar.runtime.checkpoint.checksums import (
    ChecksummingFileSystem,
    ExpectedChecksums,
    item_checksums,
    manifest_checksums,
    plain_storage,
)
from fxpar.runtime.checkpoint.lock import LOCK_FILE, Holder, release_lock
from fxpar.runtime.checkpoint.manifest import MANIFEST_FILE, METADATA_FILE


class PiecesSavePlanner(DefaultSavePlanner):
    """Write items for every piece of `GlobalTensor`s; DCP's global plan (dedup, tiling check)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self._views = {(key, p.offsets): p.view for key, t in state_dict.items() for p in t.pieces}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, tensor in self.state_dict.items():
            for piece in tensor.pieces:
                items.append(WriteItem(
                    index=MetadataIndex(key, torch.Size(piece.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.sizes)),
                        properties=TensorProperties(dtype=tensor.dtype),
                        size=torch.Size(tensor.shape),
                    ),
                ))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        view = self._views[(write_item.index.fqn, tuple(write_item.index.offset))]
        # A compact CPU copy: torch.save of a view would write its whole storage.
        return torch.empty(view.shape, dtype=view.dtype).copy_(view.detach())


class PiecesLoadPlanner(LoadPlanner):
    """Read items for every piece this rank holds now, copied straight into its view."""

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        for key, tensor in state_dict.items():
            for piece in tensor.pieces:
                self._views[(key, piece.offsets)] = piece.view

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, tensor in self.state_dict.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))
                      for p in tensor.pieces]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is stored as pickled bytes; fxpar loads "
            "tensors only and never unpickles a checkpoint's objects. Fix: load a checkpoint "
            "written by runner.save"
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self._views[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))].detach()
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            if length != view.shape[dim]:
                view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the copy went into the live tensor's view


class CommittingWriter(FileSystemWriter):
    """A FileSystemWriter into `staging` that hashes what each rank writes and, once DCP's
    metadata is written, adds fxpar's `manifest` with the checksums (JSON) and renames the
    folder to `final` (the coordinator does it, before any rank returns from the save): a crash
    at any point leaves `final` as it was. `lock`: the coordinator's hold on `staging`
    (`checkpoint_lock`), kept while the folder is cleared, released once it is committed."""

    def __init__(self, staging: Path, final: Path, manifest: dict, lock: Holder | None = None) -> None:
        super().__init__(staging, sync_files=True)
        self.fs = ChecksummingFileSystem()
        self.staging, self.final, self.manifest, self.lock = staging, final, manifest, lock

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Every rank has made the folder and none has written yet: clear what an earlier,
        # interrupted save left (files of ranks this world may not have), but this save's lock.
        for leftover in self.staging.iterdir():
            if leftover.name != LOCK_FILE:
                leftover.unlink() if leftover.is_file() else shutil.rmtree(leftover)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner) -> Future:
        results = super().write_data(plan, planner).wait()
        done: Future = Future()
        done.set_result(item_checksums(results, self.fs.written, self.staging))
        return done

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, plain_storage(results))
        checksums = manifest_checksums(results, self.staging / METADATA_FILE)
        encoded = json.dumps(self.manifest | {"checksums": checksums}, allow_nan=False, indent=1).encode()
        write_durably(self.staging / MANIFEST_FILE, encoded)
        replace_folder(self.staging, self.final)
        if self.lock is not None:
            release_lock(self.final, self.lock)


def write_durably(path: Path, data: bytes) -> None:
    """Write `path` through a temporary file, synced, then renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def replace_folder(source: Path, destination: Path) -> None:
    """Rename `source` to `destination`, replacing a folder already there (moved aside first,
    removed after: a crash between leaves the old one under `<name>.old`, never a half one)."""
    old = destination.with_name(destination.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if destination.exists():
        destination.rename(old)
    source.rename(destination)
    _sync_folder(destination.parent)
    if old.exists():
        shutil.rmtree(old)


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with the metadata unpickled by the allow-list (module doc) and,
    given the manifest's `checksums`, every item's bytes checked before `torch.load` reads them
    (`checksums.ExpectedChecksums`)."""

    def __init__(self, path: Path, checksums: dict | None = None) -> None:
        super().__init__(path)
        self.expected = ExpectedChecksums(Path(path), checksums) if checksums is not None else None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: fxpar always writes the global one
            raise FileNotFoundError("fxpar checkpoints have one global .metadata")
        return read_checkpoint_metadata(Path(self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self.expected is not None:
            for index, info in metadata.storage_data.items():
                self.expected.expect(info.relative_path, info.offset, info.length, index.fqn)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if self.expected is None:
            return super().read_data(plan, planner)
        # DCP reads the plan's items grouped by file, each file's in plan order: checked ahead
        # in the same order (`ExpectedChecksums.ahead`)
        by_file: dict[str, list[tuple[str, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            by_file.setdefault(info.relative_path, []).append((info.relative_path, info.offset))
        spans = [span for file_spans in by_file.values() for span in file_spans]
        with self.expected.ahead(spans) as self._verdict:
            return super().read_data(plan, planner)

    def _slice_file(self, file, sinfo):
        if self.expected is not None:  # its check, done ahead on the checksum thread
            self._verdict(sinfo.relative_path, sinfo.offset)
        return super()._slice_file(file, sinfo)


_ALLOWED = frozenset({
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                 "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's metadata; "
            "fxpar does not unpickle it (it could run code). Fix: load a checkpoint written by "
            "runner.save"
        )


def read_checkpoint_metadata(path: Path) -> Metadata:
    """DCP's `.metadata` of checkpoint folder `path`, unpickled by the allow-list."""
    with open(path / METADATA_FILE, "rb") as file:
        metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path / METADATA_FILE} does not hold DCP metadata")
    return metadata


def stored_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's tensors by key (an entry of pickled bytes is refused)."""
    result = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint entry {key!r} is not a tensor ({type(entry).__name__}); fxpar loads "
                "tensors only. Fix: load a checkpoint written by runner.save"
            )
        result[key] = entry
    return result

