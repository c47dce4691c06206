"""The memory budget of one device: as the user writes it ("80GB", "24 GiB", bytes), or this
machine's when not given.

Units follow their standards: GB is 10^9 bytes (a datasheet's "80GB"), GiB 2^30; a bare
number is bytes. Without a budget: a CUDA device's total memory (what `nvidia-smi` lists), and
on the CPU the machine's physical memory shared equally by the `world_size` ranks that
`torchrun --standalone` starts on it.
"""

from __future__ import annotations

import os
import re

import torch

from fxpar.errors import PlanError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def memory_budget(value: float | str | None, *, world_size: int) -> float:
    """Bytes per device: `value` read (module doc), or this machine's when None."""
    if value is None:
        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / world_size
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    match = _AMOUNT.fullmatch(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in UNITS or float(match.group(1)) <= 0:
        raise PlanError(
            f"memory_per_device {value!r} is not an amount of memory: a positive number of "
            "bytes or a number with a unit (B, KB, MB, GB, TB in powers of 10; KiB, MiB, GiB, "
            "TiB in powers of 2). Fix: memory_per_device='80GB'",
            field="memory_per_device", value=value)
    return float(match.group(1)) * UNITS[match.group(2).lower()]
