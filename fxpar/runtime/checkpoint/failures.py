"""A failed save or load as one CheckpointError: the first failing rank's real cause, named.

DCP gathers every rank's exception of a step into a `CheckpointException` (a BaseException)
whose message is `CheckpointException ranks:dict_keys([0, 1])` followed by tracebacks. fxpar
raises instead, on every rank, the first failing rank's cause:

- fxpar's own CheckpointError (a checksum that does not match, ...) as it is;
- a storage failure (an OSError: disk full, permissions, a read-only or vanished filesystem)
  as what failed, its errno, the file, and for a save the fact the commit scheme guarantees:
  the checkpoint at `path` is as it was, since a save writes into `<path>.partial` and renames
  it into place only once every file is on disk (`dcp_io.CommittingWriter`);
- anything else by its type and message, and the rank.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Literal

from torch.distributed.checkpoint.api import CheckpointException

from fxpar.errors import CheckpointError, FxparError

_FIXES = {
    errno.ENOSPC: "free space on that filesystem (or save to another one), then save again",
    errno.EDQUOT: "free space within your quota (or save to another filesystem), then save again",
    errno.EACCES: "make the folder writable by the job's user, or save elsewhere",
    errno.EPERM: "make the folder writable by the job's user, or save elsewhere",
    errno.EROFS: "save to a writable filesystem",
    errno.EIO: "check the storage device (an I/O error), then save again elsewhere",
    errno.ENOENT: "check nothing else deletes files in the checkpoint folder while it is in use",
}


def first_cause(error: BaseException) -> tuple[int | None, BaseException, list[int]]:
    """`(rank, exception, failed ranks)` of a DCP CheckpointException (the lowest failing
    rank's), or `(None, error, [])` for anything else."""
    if isinstance(error, CheckpointException) and error.failures:
        ranks = sorted(error.failures)
        return ranks[0], error.failures[ranks[0]][0], ranks
    return None, error, []


def checkpoint_failure(error: BaseException, *, action: Literal["save", "load"], path: Path,
                       existed: bool = False) -> tuple[CheckpointError, BaseException | None]:
    """The CheckpointError to raise for `error` from DCP's save or load of `path` (module doc),
    and the cause to chain it to; `existed`: a save found a checkpoint at `path` before it began."""
    rank, cause, ranks = first_cause(error)
    if isinstance(cause, CheckpointError):
        return cause, None
    where = (f" on rank {rank}" + (f" (ranks {ranks} failed; rank {rank}'s cause)" if len(ranks) > 1 else "")
             if rank is not None else "")
    if isinstance(cause, OSError):
        code = errno.errorcode.get(cause.errno, "no errno") if cause.errno is not None else "no errno"
        what = f"{cause.strerror or cause} ({code})" + (f" writing {cause.filename}" if action == "save" and
                                                         cause.filename else f" at {cause.filename}" if cause.filename else "")
        fix = _FIXES.get(cause.errno, "check the storage the folder is on, then try again")
    elif isinstance(cause, FxparError):
        what, fix = f"{type(cause).__name__}: {cause}", "the error above says what to change"
    else:
        what, fix = f"{type(cause).__name__}: {cause}", "the cause above is not fxpar's; report it if unclear"
    if action == "save":
        partial = path.with_name(path.name + ".partial")
        kept = (f"The checkpoint already at {path} is intact: the save wrote into {partial}, which is renamed into "
                "place only once complete" if existed else f"Nothing was committed to {path}; {partial} holds the "
                "unfinished save, which the next save there replaces")
        return CheckpointError(f"saving checkpoint {path} failed{where}: {what}. {kept}. Fix: {fix}"), cause
    return CheckpointError(f"loading checkpoint {path} failed{where}: {what}. The model and optimizer may be "
                           f"partly loaded: load again before training. Fix: {fix}"), cause
