"""Hardware profiles by name: the nominal ones of `cost.hardware`, and "cpu", measured here.

Its own module because it is the one place that needs both the profiles and the calibration
that measures this machine (`cost.calibrate`, which itself builds on `cost.hardware`).
"""

from __future__ import annotations

from fxpar.cost.calibrate import measure_cpu
from fxpar.cost.hardware import NOMINAL_CPU, PROFILES, Hardware

KNOWN = ("cpu", *PROFILES)


def hardware_profile(name: str, *, measured: bool = True) -> Hardware:
    """The profile called `name`; a ValueError lists the known ones.

    "cpu" is measured on this machine (a few seconds once, then cached on disk) unless
    `measured=False`, which returns nominal constants.
    """
    if name == "cpu":
        if not measured:
            return NOMINAL_CPU
        return measure_cpu()
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known profiles: {', '.join(KNOWN)}") from None
