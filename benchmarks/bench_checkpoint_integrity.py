"""What a checkpoint's checksums cost (`runtime.checkpoint.checksums`) against save and load time.

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint_integrity.py --gib 1 --repeats 5

Target: at most 5% of a save and of a load. The state is `--gib` GiB of fp32 tensors (64 MiB
each, one piece per tensor, as a rank of a dp=1 run holds them) saved and loaded through
fxpar's own DCP planners, writer and reader (`dcp_io`), in one process:

    save, checked      CommittingWriter: the hash of each item as it is written, the manifest's
                       checksums, fsync'd files, the folder renamed into place
    save, unchecked    the same writer with DCP's plain FileSystem and a manifest without
                       checksums: fxpar's save before them
    load, checked      SafeReader with the manifest's checksums: every item's bytes read and
                       hashed before torch.load reads them (the stat of every file and the hash
                       of `.metadata` first, as runner.load does)
    load, unchecked    SafeReader without them: DCP reads straight from the file

Wall-clock medians of `--repeats` (the variants alternate, so drift hits both), the median
of each repeat's checked/unchecked ratio (`paired`), and the hashing alone as a share of the
unchecked time (`hashing`: what checking costs where nothing else moves). Each load runs
twice: `load, cold` after the folder's pages are dropped from the page cache
(`posix_fadvise(DONTNEED)`: read from the disk, as a restarted job does) and `load, warm` right
after (from memory, where the second pass over the bytes costs most relative to the read).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from fxpar.runtime.checkpoint.checksums import check_files_present, verify_file
from fxpar.runtime.checkpoint.manifest import MANIFEST_FILE, METADATA_FILE
from fxpar.runtime.checkpoint.pieces import GlobalTensor, Piece
from fxpar.runtime.checkpoint.dcp_io import (
    CommittingWriter, PiecesLoadPlanner, PiecesSavePlanner, SafeReader, replace_folder, write_durably,
)

TENSOR_ELEMENTS = 16 << 20  # 64 MiB of fp32


class UncheckedWriter(CommittingWriter):
    """fxpar's committing writer as it was before checksums (module doc)."""

    def __init__(self, staging: Path, final: Path, manifest: dict) -> None:
        super().__init__(staging, final, manifest)
        self.fs = FileSystem()

    def write_data(self, plan, planner):
        return FileSystemWriter.write_data(self, plan, planner)

    def finish(self, metadata, results) -> None:
        FileSystemWriter.finish(self, metadata, results)
        write_durably(self.staging / MANIFEST_FILE, json.dumps(self.manifest).encode())
        replace_folder(self.staging, self.final)


def state(gib: float) -> dict[str, GlobalTensor]:
    count = max(1, round(gib * (1 << 30) / (TENSOR_ELEMENTS * 4)))
    tensors = {}
    for index in range(count):
        value = torch.randn(TENSOR_ELEMENTS // 4096, 4096)
        tensors[f"layer.{index}.weight"] = GlobalTensor(tuple(value.shape), value.dtype, [Piece((0, 0), value)])
    return tensors


def save(tensors: dict, folder: Path, *, checked: bool) -> float:
    staging = folder.with_name(folder.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    manifest = {"format": "fxpar-checkpoint", "version": 2 if checked else 1}
    writer = (CommittingWriter(staging, folder, manifest) if checked else UncheckedWriter(staging, folder, manifest))
    start = time.perf_counter()
    dcp.save(tensors, storage_writer=writer, planner=PiecesSavePlanner())
    return time.perf_counter() - start


def load(tensors: dict, folder: Path, *, checked: bool) -> float:
    start = time.perf_counter()
    checksums = json.loads((folder / MANIFEST_FILE).read_text())["checksums"] if checked else None
    if checked:
        check_files_present(folder, checksums)
        verify_file(folder, METADATA_FILE, checksums)
    dcp.load(tensors, storage_reader=SafeReader(folder, checksums), planner=PiecesLoadPlanner())
    return time.perf_counter() - start


def hash_seconds(tensors: dict) -> float:
    """The best of three XXH3 passes over every tensor's bytes: what checking adds, free of
    the disk's and the page cache's noise, which moves a 1 GiB save by +-10% here."""
    views = [memoryview(p.view.numpy()).cast("B") for t in tensors.values() for p in t.pieces]
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for view in views:
            xxhash.xxh3_64(view).hexdigest()
        best = min(best, time.perf_counter() - start)
    return best


def drop_from_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of state to save and load")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tensors = state(args.gib)
    total = sum(p.view.numel() * p.view.element_size() for t in tensors.values() for p in t.pieces)
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="fxpar-bench-ck-"))
    actions = ("save", "load, cold", "load, warm")
    times: dict[tuple[str, bool], list[float]] = {(a, c): [] for a in actions for c in (True, False)}
    try:
        for repeat in range(args.repeats + 1):  # the first round warms up, untimed
            for checked in (True, False) if repeat % 2 else (False, True):
                folder = root / ("checked" if checked else "unchecked")
                saved = save(tensors, folder, checked=checked)
                drop_from_page_cache(folder)
                cold, warm = load(tensors, folder, checked=checked), load(tensors, folder, checked=checked)
                if repeat:
                    for action, seconds in zip(actions, (saved, cold, warm)):
                        times[(action, checked)].append(seconds)
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    hashing = hash_seconds(tensors)
    print(f"{total / (1 << 30):.2f} GiB in {len(tensors)} tensors, median of {args.repeats}, wall seconds")
    print(f"{'':10} {'unchecked':>10} {'checked':>10} {'cost':>8} {'paired':>8} {'hashing':>8}")
    for action in actions:
        unchecked, checked = (statistics.median(times[(action, c)]) for c in (False, True))
        paired = statistics.median(c / u for u, c in zip(times[(action, False)], times[(action, True)]))
        print(f"{action:10} {unchecked:10.3f} {checked:10.3f} {(checked / unchecked - 1) * 100:+7.1f}% "
              f"{(paired - 1) * 100:+7.1f}% {hashing / unchecked * 100:7.1f}%")
    print(f"hashing: XXH3 over every byte once, {hashing:.3f} s, the work checking adds (a save does it "
          "in line, a load on a thread ahead of its reads)")


if __name__ == "__main__":
    main()
