"""The torchrun environment of this process (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fxpar.errors import BindError

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnvironment:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def read(cls, *, expected_world_size: int) -> TorchrunEnvironment:
        """Read the variables torchrun sets; outside torchrun, explain how to launch."""
        missing = [name for name in _REQUIRED if name not in os.environ]
        if missing:
            raise BindError(
                f"program.bind() must run inside a torchrun worker, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set. Launch the script with:\n"
                f"    torchrun --standalone --nproc-per-node {expected_world_size} your_script.py\n"
                "(on several nodes: torchrun --nnodes N --nproc-per-node G "
                "--rdzv-backend c10d --rdzv-endpoint HOST:PORT your_script.py)"
            )
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ["LOCAL_RANK"]),
        )
