"""What a failed collective or group creation says: how long it really waited, and why.

A collective fails in one of two ways, and the fix differs:

* it *timed out*: it waited its whole timeout and a peer never joined (the peer hangs, is slow,
  or issues another collective);
* it *failed early*: the backend saw a peer go away (`Connection closed by peer`, `Connection
  refused`) long before the timeout, because the peer crashed or exited.

So a message says which, with the time really waited (a collective that failed after 0.05 s
must not claim it "did not complete within 30 s"), and names the peer rank when that is known
for certain: when the backend's text names a peer rank, or when the group has two ranks, so
that "the peer" can only be the other one. gloo names peers by address (`[127.0.0.1]:4846`),
which does not identify a rank on one host, so nothing more is guessed. The backend's text is
kept, on one line, without its source location (`[.../gloo/transport/tcp/pair.cc:553]`).

    describe_failure(error, ranks=(0, 1), rank=0, waited=0.04, timeout=timedelta(seconds=30))
    -> "failed after 0.04 s, well before its 30 s timeout: rank 1 is gone (its connection
        was closed or refused: it probably exited or crashed; its own log says why).
        RuntimeError: Connection closed by peer [127.0.0.1]:4846. ..."
"""

from __future__ import annotations

import re
from datetime import timedelta


_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_NAMED_PEER = re.compile(r"\b(?:peer|remote|from|to)\s+rank\s*[:=]?\s*(\d+)", re.IGNORECASE)
_PEER_GONE = re.compile(r"closed by peer|connection refused|connection reset|broken pipe|"
                        r"timed out connecting|remote worker crash", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed out waiting|timeout after|wait timeout|timed out after", re.IGNORECASE)


def describe_failure(
    error: BaseException, *, ranks: tuple[int, ...], rank: int, waited: float, timeout: timedelta
) -> str:
    """The cause of a failure, seen by global `rank`, on the group of global `ranks` after
    `waited` seconds, for a CollectiveError or BindError message (see the module doc)."""
    text = backend_text(error)
    limit = timeout.total_seconds()
    peer = peer_rank(text, ranks=ranks, rank=rank)
    who = f"rank {peer}" if peer is not None else "a peer rank"
    if _PEER_GONE.search(text) and waited < 0.9 * limit:
        cause = (
            f"failed after {waited:.2f} s, well before its {limit:g} s timeout: {who} is gone "
            "(its connection was closed or refused: it probably exited or crashed; its own log "
            "says why)"
        )
    elif waited >= 0.9 * limit or _TIMED_OUT.search(text):
        cause = (
            f"did not complete within {limit:g} s (waited {waited:.1f} s): {who} never joined "
            "(it may have died, hung, or be issuing another collective; its own log says why)"
        )
    else:
        cause = f"failed after {waited:.2f} s (its timeout is {limit:g} s)"
    return f"{cause}. {type(error).__name__}: {text}"


def backend_text(error: BaseException) -> str:
    """The error's text on one line, without C++ source locations, at most 400 characters."""
    text = " ".join(_SOURCE_LOCATION.sub("", str(error)).split())
    return text[:400] + ("…" if len(text) > 400 else "")


def peer_rank(text: str, *, ranks: tuple[int, ...], rank: int) -> int | None:
    """The peer the backend's `text` says failed, when that is certain; else None."""
    named = {int(r) for r in _NAMED_PEER.findall(text)} & set(ranks) - {rank}
    if len(named) == 1:
        return named.pop()
    if len(ranks) == 2 and rank in ranks and _PEER_GONE.search(text):
        (other,) = set(ranks) - {rank}
        return other
    return None
