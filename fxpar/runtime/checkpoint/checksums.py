"""Checksums of a checkpoint's bytes: computed as DCP writes them, checked as it reads them.

A save's shard files (`__<rank>_<n>.distcp`) hold one stored item after another: a chunk of a
tensor as `torch.save` writes it, at the byte offset and length DCP's `.metadata` records.
fxpar records in the manifest (`fxpar.json`, `manifest`) each file's size and a
hash of every item's byte range; the items tile the file from byte 0 to its size, so every
byte is covered once. DCP's `.metadata` is one item of its own (its key `.metadata`):

    "checksums": {"algorithm": "xxh3_64", "files": {
        "__0_0.distcp": {"size": 41207, "items": [
            {"key": "wte.weight", "chunk": [0, 0], "offset": 0, "length": 8939, "hash": "9c0e6f3b1d2a4e57"},
            {"key": "optim.state.wte.weight.exp_avg", "chunk": [0, 0], "offset": 8939, ...}, ...]},
        ".metadata": {"size": 5120, "items": [{"key": ".metadata", "chunk": [], "offset": 0, ...}]}}}

Writing: `ChecksummingFileSystem` hands DCP streams that hash each `write` as it passes, cut
at the `tell()` DCP calls before and after each item, so nothing is read back (`item_checksums`
reads a range back only if a future DCP wrote an item in pieces that do not line up).
Reading: every rank checks that each listed file is there at its size before DCP starts
(`check_files_present`: a deleted or truncated shard is named before any collective),
`.metadata` is checked before it is unpickled (`verify_file`), and `ExpectedChecksums.ahead`
checks each item's bytes on a thread that runs ahead of DCP's reads, each item before
`torch.load` reads it (through one reused buffer: a load allocates nothing more).
`checkpoint.verify_checkpoint` re-reads a whole folder in one process (an offline check).

[Note: why xxh3_64] The threat is damage (flipped bits, a truncated or swapped file, a
half-copied folder), not an adversary, so a fast non-cryptographic hash with good dispersion
suffices: XXH3 (64 bits, SMHasher-clean) misses a damaged item with probability 2^-64. Speed
decides: a load from the page cache moves ~1 GB/s here, and a checksum at zlib's CRC-32 speed
(~2-4 GB/s on one core) cost it +84% and a save +56% at 1 GiB; XXH3 hashes at ~10 GB/s
(`xxhash`, which releases the GIL). sha256 (~1.8 GB/s) and blake2b (~0.65 GB/s) would guard
against forgery, which a folder anyone can write cannot have anyway. Measured against save
and load time in `benchmarks/bench_checkpoint_integrity.py`.
"""

from __future__ import annotations

import dataclasses
import io
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo

from fxpar.errors import CheckpointError

ALGORITHM = "xxh3_64"
_READ_BLOCK = 8 << 20  # bytes read and hashed at a time when a range is checked
_FIX = "Fix: load an earlier checkpoint (latest_checkpoint lists them) or restore the folder from a copy"


@dataclass
class ChecksummedStorage(_StorageInfo):
    """DCP's `_StorageInfo` of one written item with its hash and its file's size: what a rank
    sends the coordinator (`CommittingWriter.write_data`), which puts them in the manifest and
    hands DCP plain `_StorageInfo`s for `.metadata` (`plain_storage`)."""

    hash: str = ""
    file_size: int = 0


@dataclass
class _Written:
    """What a `_ChecksummingStream` saw: the file's size and the hash of each span between two
    `tell()`s, by its start: `{start: (end, hash)}`."""

    size: int = 0
    spans: dict[int, tuple[int, str]] = field(default_factory=dict)
    sequential: bool = True  # False once anything seeked: the spans no longer say where bytes lie


class _ChecksummingStream:
    """A binary file being written that hashes what passes through it (module doc)."""

    def __init__(self, raw, path: Path) -> None:
        self.raw, self.path, self.seen = raw, path, _Written()
        self._span_start, self._span = 0, xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        view = view if view.ndim == 1 and view.format in ("B", "b", "c") else view.cast("B")
        try:
            written = self.raw.write(view)
        except OSError as error:  # name the file: a write's OSError does not
            if error.filename is None:
                raise OSError(error.errno, error.strerror, str(self.path)) from error
            raise
        written = len(view) if written is None else written
        self._span.update(view[:written])
        self.seen.size += written
        return written

    def tell(self) -> int:
        position = self.raw.tell()
        if position != self._span_start:
            self.seen.spans[self._span_start] = (position, self._span.hexdigest())
        self._span_start = position
        self._span.reset()
        return position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.seen.sequential = False
        return self.raw.seek(offset, whence)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()


class ChecksummingFileSystem(FileSystem):
    """DCP's local FileSystem whose written files are hashed on the way (`written`, by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, _Written] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with self.open_for_writing(path, mode) as raw:
            stream = _ChecksummingStream(raw, path)
            yield stream
            self.written[path.name] = stream.seen

    def open_for_writing(self, path: Path, mode: str):
        """The raw file (the tests replace this to fill the disk up)."""
        return path.open(mode)


def item_checksums(results: list, written: dict[str, _Written], folder: Path) -> list:
    """This rank's DCP WriteResults with `ChecksummedStorage`: each item's hash from the spans
    its stream saw, or read back from `folder` when they do not line up with it."""
    checked = []
    for result in results:
        info = result.storage_data
        seen = written[info.relative_path]
        end, digest = seen.spans.get(info.offset, (None, ""))
        if not seen.sequential or end != info.offset + info.length:
            with open(folder / info.relative_path, "rb") as file:
                digest = range_hash(file, info.offset, info.length)[0]
        storage = ChecksummedStorage(info.relative_path, info.offset, info.length, info.transform_descriptors,
                                     hash=digest, file_size=seen.size)
        checked.append(dataclasses.replace(result, storage_data=storage))
    return checked


def manifest_checksums(results: list[list], metadata_file: Path) -> dict:
    """The manifest's `checksums` from every rank's results (the coordinator's), with DCP's
    `.metadata`, which the coordinator has just written, as one item."""
    files: dict[str, dict] = {}
    for result in (r for rank in results for r in rank):
        info: ChecksummedStorage = result.storage_data
        entry = files.setdefault(info.relative_path, {"size": info.file_size, "items": []})
        entry["items"].append({"key": result.index.fqn, "chunk": list(result.index.offset or ()),
                               "offset": info.offset, "length": info.length, "hash": info.hash})
    for entry in files.values():
        entry["items"].sort(key=lambda item: item["offset"])
    size = metadata_file.stat().st_size
    with open(metadata_file, "rb") as file:
        digest = range_hash(file, 0, size)[0]
    files[metadata_file.name] = {"size": size, "items": [{
        "key": metadata_file.name, "chunk": [], "offset": 0, "length": size, "hash": digest}]}
    return {"algorithm": ALGORITHM, "files": files}


def plain_storage(results: list[list]) -> list[list]:
    """The results as DCP wrote them: `.metadata` keeps DCP's own `_StorageInfo` only."""
    def plain(info):
        return _StorageInfo(info.relative_path, info.offset, info.length, info.transform_descriptors)
    return [[dataclasses.replace(r, storage_data=plain(r.storage_data)) for r in rank] for rank in results]


def range_hash(file, offset: int, length: int, buffer: bytearray | None = None) -> tuple[str, int]:
    """(hash, bytes read) of `length` bytes of the open `file` from `offset`, read in blocks
    into `buffer` (reused across calls: no allocation per item)."""
    buffer = buffer if buffer is not None else bytearray(min(length, _READ_BLOCK))
    view, hasher, done = memoryview(buffer), xxhash.xxh3_64(), 0
    file.seek(offset)
    while done < length:
        count = file.readinto(view[: min(length - done, len(view))])
        if not count:
            break
        hasher.update(view[:count])
        done += count
    return hasher.hexdigest(), done


def check_files_present(folder: Path, checksums: dict) -> None:
    """Every file the manifest lists is in `folder` at its size (a stat each), else a
    CheckpointError naming the file: every rank runs it before DCP's first collective."""
    for name, entry in checksums["files"].items():
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {folder} lacks {name}, which its save wrote ({entry['size']:,} bytes "
                                  f"holding {_keys(entry)}; fxpar.json lists it): the folder is incomplete. "
                                  f"{_FIX}") from None
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            first = next((i for i in entry["items"] if i["offset"] + i["length"] > size), None)
            where = f"; the first item it cuts is {_described(first)} at byte offset {first['offset']:,}" if first else ""
            raise CheckpointError(f"checkpoint file {path} is {size:,} bytes, but its save wrote {entry['size']:,} "
                                  f"(fxpar.json): it is {what}{where}. {_FIX}")


def verify_file(folder: Path, name: str, checksums: dict) -> None:
    """File `name` of `folder` holds the bytes its save wrote (every item's hash), else a
    CheckpointError naming it: `.metadata` is checked so before it is unpickled."""
    entry = checksums["files"].get(name)
    if entry is None:
        raise CheckpointError(f"checkpoint {folder}: fxpar.json has no checksum of {name}. {_FIX}")
    expected = ExpectedChecksums(folder, {"files": {name: entry}})
    with open(folder / name, "rb") as file:
        for item in entry["items"]:
            expected.verify(file, name, item["offset"])


class ExpectedChecksums:
    """The manifest's item hashes by (file, offset), checked against the bytes a load reads."""

    def __init__(self, folder: Path, checksums: dict) -> None:
        self.folder, self.buffer = folder, bytearray(_READ_BLOCK)
        self.items = {(name, item["offset"]): item
                      for name, entry in checksums["files"].items() for item in entry["items"]}

    def expect(self, relative_path: str, offset: int, length: int, key: str) -> None:
        """`.metadata`'s item `key` at `relative_path`/`offset` is one the manifest has a hash of."""
        item = self.items.get((relative_path, offset))
        if item is None or item["length"] != length or item["key"] != key:
            raise CheckpointError(
                f"checkpoint {self.folder}: .metadata puts {key!r} at bytes {offset:,}..{offset + length:,} of "
                f"{relative_path}, where fxpar.json has {_described(item)}: the two files are of different saves. "
                f"{_FIX}"
            )

    def verify(self, file, relative_path: str, offset: int, buffer: bytearray | None = None) -> None:
        """The item at `offset` of the open `file` (`relative_path`) holds what was written
        there, else a CheckpointError naming the file, key and offset."""
        item = self.items[(relative_path, offset)]
        digest, read = range_hash(file, offset, item["length"], buffer if buffer is not None else self.buffer)
        if read != item["length"] or digest != item["hash"]:
            raise CheckpointError(
                f"checkpoint file {self.folder / relative_path}: the {item['length']:,} bytes at byte offset "
                f"{offset:,}, which hold {_described(item)}, hash to {ALGORITHM} {digest} ({read:,} bytes read), "
                f"but the save wrote {item['hash']}: the file was changed or damaged after it was written. {_FIX}"
            )

    @contextmanager
    def ahead(self, spans: list[tuple[str, int]]):
        """Check the items at `spans` ((file, offset) in the order a load reads them) on a
        thread of their own while the load runs; yields `verdict(file, offset)`, which waits
        for that item's check and raises its CheckpointError.

        [Note: why a thread] Checking each item just before `torch.load` reads it costs a
        second pass over the bytes in the load's own time: +56% at 1 GiB from the page cache,
        where the load moves about 1 GB/s (deserialising, then copying into the rank's
        tensors) and the check 10 GB/s. The file reads and XXH3 release the GIL, so on a
        thread the check runs ahead of the load, on the same order of items, and the load
        only waits where it catches up. An item is still checked before its bytes reach a
        tensor of the rank; a damaged item stops the load there, with the items before it
        already loaded (a load that fails leaves the rank's state partly read: load an
        intact checkpoint next)."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fxpar-checksums")
        buffer = bytearray(_READ_BLOCK)  # the thread's own, reused by its checks one after another
        futures = {span: executor.submit(self._verify_at, *span, buffer) for span in dict.fromkeys(spans)}
        try:
            yield lambda relative_path, offset: futures[(relative_path, offset)].result()
        finally:
            executor.shutdown(wait=True, cancel_futures=True)

    def _verify_at(self, relative_path: str, offset: int, buffer: bytearray) -> None:
        with open(self.folder / relative_path, "rb") as file:
            self.verify(file, relative_path, offset, buffer)


def _described(item: dict | None) -> str:
    if item is None:
        return "no item"
    return f"{item['key']!r}" + (f" (its chunk at {tuple(item['chunk'])})" if item["chunk"] else "")


def _keys(entry: dict) -> str:
    keys = [repr(item["key"]) for item in entry["items"]]
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
