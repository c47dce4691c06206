"""A pipeline action: one stage's forward, backward or weight gradient of one microbatch.

Its own module because both the schedules (`fxpar.schedule.schedules`, which order actions) and the
simulator (`fxpar.schedule.simulation`, which times them) build actions, and the schedules print
themselves through the simulator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_ACTION = re.compile(r"(\d+)([FBW])(\d+)")
ActionKind = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Action:
    """One step: `stage` runs the forward ("F"), backward ("B") or, in a split schedule, the
    weight gradient ("W", [Note: B and W]) of `microbatch`; str "1F0"."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """`Action.parse("1F0") == Action(1, "F", 0)`, "0W3" too; the inverse of `str`."""
        found = _ACTION.fullmatch(text.strip())
        if found is None:
            raise ValueError(
                f"cannot read action {text!r}: expected <stage><F|B|W><microbatch>, e.g. '1F0'"
            )
        return cls(int(found[1]), found[2], int(found[3]))  # type: ignore[arg-type]
