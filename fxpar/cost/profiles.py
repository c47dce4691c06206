"""Hardware profiles by name: the nominal ones of `cost.hardware`, and "cpu", measured here.

Its own module because it is the one place that needs both the profiles and the calibration
that measures this machine (`cost.calibrate`, which itself builds on `cost.hardware`).
"""

from __future__ import annotations

from fxpar.cost.calibrate import measure_cpu
from fxpar.cost.hardware import NOMINAL_CPU, PROFILES, Hardware
from fxpar.cost.profile_files import is_profile_file, load_profile

KNOWN = ("cpu", *PROFILES)


def hardware_profile(name: str, *, measured: bool = True) -> Hardware:
    """The profile called `name`, or the one a profile file `name` (`*.json`,
    `cost.profile_files`) holds; a ValueError lists the known ones.

    "cpu" is measured on this machine (a few seconds once, then cached on disk) unless
    `measured=False`, which returns nominal constants. A file is read as it is either way.
    """
    if is_profile_file(name):
        return load_profile(name)
    if name == "cpu":
        if not measured:
            return NOMINAL_CPU
        return measure_cpu()
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known profiles: {', '.join(KNOWN)}, or a profile "
                         "file FILE.json (`python -m fxpar.cost.calibrate -o FILE.json` writes one)") from None
