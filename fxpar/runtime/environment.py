"""What `program.bind()` is given: the torchrun environment of this process, and its timeout.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every worker.
`TorchrunEnvironment.read` checks each before any process group exists, because a wrong one
otherwise fails late and obscurely: a RANK outside WORLD_SIZE waits for peers that never come
until the store's network timeout, a MASTER_PORT of "abc" is a ValueError deep inside
torch.distributed. Each message names the variable, its value and the fix.

`bind_timeout` does the same for `bind(timeout=...)`: a positive, finite number of seconds or
a `timedelta`, or a clear error naming the value (a timeout of 0 would fail every collective at
once, `inf` or NaN would overflow or wait forever, and "5" is a string, not a number).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from datetime import timedelta

from fxpar.errors import BindError, shown

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnvironment:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def read(cls, *, expected_world_size: int) -> TorchrunEnvironment:
        """Read and check the variables torchrun sets; outside torchrun, explain how to launch."""
        missing = [name for name in _REQUIRED if name not in os.environ]
        launch = (
            f"    torchrun --standalone --nproc-per-node {expected_world_size} your_script.py\n"
            "(on several nodes: torchrun --nnodes N --nproc-per-node G "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT your_script.py)"
        )
        if missing:
            raise BindError(
                f"program.bind() must run inside a torchrun worker, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set. Launch the script with:\n{launch}"
            )
        world_size = _integer("WORLD_SIZE", minimum=1, launch=launch)
        rank = _integer("RANK", minimum=0, launch=launch)
        local_rank = _integer("LOCAL_RANK", minimum=0, launch=launch)
        if rank >= world_size:
            raise BindError(
                f"environment variable RANK={rank} is outside WORLD_SIZE={world_size}: ranks "
                f"are 0 to {world_size - 1}, and a rank outside would wait for peers that never "
                f"come. Fix: let torchrun set both; launch with:\n{launch}"
            )
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        if local_world.isdigit() and local_rank >= int(local_world):
            raise BindError(
                f"environment variable LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE="
                f"{int(local_world)} (the processes on this node). Fix: let torchrun set both"
            )
        if not os.environ["MASTER_ADDR"].strip():
            raise BindError(
                "environment variable MASTER_ADDR is empty: it names the host of rank 0's store. "
                f"Fix: let torchrun set it (--rdzv-endpoint HOST:PORT), or launch with:\n{launch}"
            )
        _integer("MASTER_PORT", minimum=1, maximum=65535, launch=launch)
        return cls(rank=rank, world_size=world_size, local_rank=local_rank)


def _integer(name: str, *, minimum: int, launch: str, maximum: int | None = None) -> int:
    text = os.environ[name]
    value = int(text) if text.strip().lstrip("+-").isdigit() and len(text) < 20 else None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bounds = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
        raise BindError(
            f"environment variable {name}={shown(text)} is not an integer {bounds}. Fix: let "
            f"torchrun set it; launch with:\n{launch}"
        )
    return value


def bind_timeout(timeout: object) -> timedelta:
    """`bind(timeout=...)` as a timedelta: seconds (int or float) or a timedelta, positive and
    finite; TypeError or ValueError naming the value otherwise."""
    fix = "Fix: bind(timeout=300) (seconds) or bind(timeout=timedelta(minutes=5))"
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"bind(timeout={shown(timeout)}): the timeout is a {type(timeout).__name__}; it must "
            f"be a number of seconds or a datetime.timedelta. {fix}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"bind(timeout={shown(timeout)}): the timeout must be positive and finite: it bounds "
            f"every collective, so that a dead peer fails the others instead of hanging them. {fix}"
        )
    try:
        return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"bind(timeout={shown(timeout)}): the timeout is too large. {fix}") from None
