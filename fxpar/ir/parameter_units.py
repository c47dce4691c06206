"""ZeRO-3's parameter units: the parameters one gather moves together (`passes.zero3`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParameterUnit:
    """The parameters one ZeRO-3 gather moves together: a layer, in gather order."""

    index: int
    layer: str  # the module path the unit stands for ("" for the root)
    parameters: tuple[str, ...]
