"""Hardware profiles by name: the nominal ones of `cost.hardware`, "cpu", measured here, and
the ones measured on other machines that fxpar ships as files (`fxpar/cost/measured/`: "h200",
fitted on one H200's microbenchmarks by `benchmarks/fit_h200_profile.py`).

Its own module because it is the one place that needs both the profiles and the calibration
that measures this machine (`cost.calibrate`, which itself builds on `cost.hardware`).
"""

from __future__ import annotations

import functools
from pathlib import Path

from fxpar.cost.calibrate import measure_cpu
from fxpar.cost.hardware import NOMINAL_CPU, PROFILES, Hardware
from fxpar.cost.profile_files import is_profile_file, load_profile

SHIPPED = {path.stem: path for path in sorted((Path(__file__).parent / "measured").glob("*.json"))}
KNOWN = ("cpu", *PROFILES, *SHIPPED)


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
    if name in SHIPPED:
        return _shipped(name)
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known profiles: {', '.join(KNOWN)}, or a profile "
                         "file FILE.json (`python -m fxpar.cost.calibrate -o FILE.json` writes one)") from None


@functools.cache
def _shipped(name: str) -> Hardware:
    return load_profile(SHIPPED[name])
