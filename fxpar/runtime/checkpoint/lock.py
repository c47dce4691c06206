"""Before a save writes anything: every rank names the same folder, and no other job writes it.

`claim_folder(path)`, which every rank of a save calls, runs three small object all-gathers on
the default process group (bind's finite timeout, as DCP's own; outside any step):

1. **One folder.** Each rank sends the absolute path it resolved. Ranks that name different
   folders (`ck/rp_{rank}`) would each write a part of a checkpoint no folder holds whole; every
   rank raises a CheckpointError naming the ranks and their paths, and nothing is written.
2. **One writer.** Rank 0 makes `<path>.partial` and creates the lock file `.fxpar.lock` in it
   (`O_CREAT | O_EXCL`), holding `{"job", "host", "pid", "time"}`; every rank raises rank 0's
   CheckpointError if another job holds it.
3. **One filesystem.** Every other rank checks it sees that lock: a folder on a node-local disk
   would leave each node a part of the checkpoint.

[Note: when a lock is stale] A job is `TORCHELASTIC_RUN_ID` (torchrun's, kept across its
restarts; `host:pid` outside torchrun). A lock of the same job is a save of it that did not
finish (a crash, a restart): it is taken over. Another job's lock is honoured unless it is stale:
its host is this host and its pid runs no more, or it is older than `STALE_AFTER_S` (no save
takes an hour); a stale lock is taken over with a warning naming it. Otherwise the error says
how to remove it. The lock lives in `<path>.partial` only: the commit renames the folder into
place and then deletes the lock (`dcp_io.CommittingWriter.finish`); a failed save releases it.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from fxpar.errors import CheckpointError

LOCK_FILE = ".fxpar.lock"
STALE_AFTER_S = 3600.0
_BEING_WRITTEN_S = 10.0  # an unreadable lock younger than this may be one its holder is writing


@dataclass(frozen=True)
class Holder:
    """Who holds a folder's lock."""

    job: str
    host: str
    pid: int
    time: float

    def __str__(self) -> str:
        return f"job {self.job!r} (host {self.host}, pid {self.pid}, since {time.ctime(self.time)})"


def this_job() -> Holder:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    host, pid = socket.gethostname(), os.getpid()
    return Holder(job=run if run and run != "none" else f"{host}:{pid}", host=host, pid=pid, time=time.time())


def claim_folder(final: Path, staging: Path) -> Holder | None:
    """Steps 1-3 of the module doc on every rank; rank 0's lock (None on other ranks)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    paths = _all_gather(str(final.absolute().resolve()), world)
    if len(set(paths)) > 1:
        listed = "; ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise CheckpointError(f"runner.save was given different folders on different ranks ({listed}): each "
                              "rank would write its part of one checkpoint into another folder, and none would be "
                              "complete. Nothing was written. Fix: pass every rank the same path (not one made from "
                              "the rank), on a filesystem all ranks share")
    held, problem = None, None
    if rank == 0:
        try:
            held = take_lock(staging)
        except CheckpointError as error:
            problem = str(error)
        except OSError as error:
            problem = f"could not make {staging} or its lock: {error}. Fix: check the folder's permissions and space"
    problem = _all_gather(problem, world)[0]
    if problem is not None:
        raise CheckpointError(problem)
    seen = _all_gather(rank == 0 or (staging / LOCK_FILE).is_file(), world)
    if not all(seen):
        blind = [r for r, s in enumerate(seen) if not s]
        if held is not None:
            release_lock(staging, held)
        raise CheckpointError(f"rank(s) {blind} do not see {staging / LOCK_FILE}, which rank 0 just created: "
                              f"{final.parent} is not one filesystem shared by all ranks (a node-local disk?), so "
                              "no rank could commit the whole checkpoint. Fix: save to a shared filesystem")
    return held


def take_lock(staging: Path) -> Holder:
    """Make `staging` and hold its lock for this job, taking over one of the same job or a
    stale one (module note); a CheckpointError naming the other job otherwise."""
    staging.mkdir(parents=True, exist_ok=True)
    me = this_job()
    lock = staging / LOCK_FILE
    for _ in range(3):  # another job may remove or take a stale lock between our tries
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            other = read_holder(lock)
            if other is None and _age(lock) < _BEING_WRITTEN_S:  # its holder may still be writing it
                other = Holder(job="unknown (its lock is being written)", host="?", pid=0, time=time.time())
            if other is not None and other.job != me.job and not _stale(other):
                raise CheckpointError(
                    f"{staging} is being written by another {other}: two jobs saving into one folder would mix "
                    f"their files. Fix: give each job its own checkpoint folder; if that job is no longer running, "
                    f"delete {lock} (it is taken over by itself after {STALE_AFTER_S / 3600:g} h)"
                ) from None
            if other is not None and other.job != me.job:
                warnings.warn(f"fxpar: taking over the stale lock of {other} on {staging} (module note of "
                              "fxpar.runtime.checkpoint.lock)", stacklevel=5)
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(descriptor, "w") as file:
            json.dump(me.__dict__, file)
        return me
    raise CheckpointError(f"could not take the lock {lock}: other processes keep creating it. Fix: give each job "
                          "its own checkpoint folder")


def read_holder(lock: Path) -> Holder | None:
    """The lock's holder, or None for a lock that cannot be read (a holder that died while
    writing it, or damage): taken over once `_BEING_WRITTEN_S` old, as it names no one to wait for."""
    try:
        fields = json.loads(lock.read_text())
        return Holder(job=str(fields["job"]), host=str(fields["host"]), pid=int(fields["pid"]),
                      time=float(fields["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def release_lock(folder: Path, holder: Holder) -> None:
    """Delete `folder`'s lock if `holder` still holds it (a failed save, or after the commit)."""
    lock = folder / LOCK_FILE
    current = read_holder(lock)
    if current is not None and (current.job, current.pid) == (holder.job, holder.pid):
        lock.unlink(missing_ok=True)


def _age(lock: Path) -> float:
    try:
        return time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return _BEING_WRITTEN_S  # gone meanwhile: the next try creates it


def _stale(holder: Holder) -> bool:
    if time.time() - holder.time > STALE_AFTER_S:
        return True
    if holder.pid <= 0 or holder.host != socket.gethostname():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _all_gather(value, world: int) -> list:
    if world == 1:
        return [value]
    gathered = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered
