"""Hardware profiles as files: a measured machine, written once, read by every estimate.

`python -m fxpar.cost.calibrate -o profile.json` writes the profile measured here; then
`program.estimate("profile.json")`, `fxpar.compile(..., hardware="profile.json")` and the
CLI's `--hardware profile.json` read it, so a plan can be priced for a machine on another
one, and every rank of a job prices with the same numbers. The file is JSON, one key per
field of `cost.hardware.Hardware` (the links as {"alpha", "bandwidth", "wait"}, the wait
optional; `matmul_tables`, optional, as {precision: {"points": [[m, k, n, FLOP/s], ...]}}),
beside a format version:

    {"format": "fxpar-hardware/1", "name": "cpu", "peak_flops": {"fp32": 1.04e11, ...},
     "matmul_efficiency": 1.0, "memory_bandwidth": 3.2e10, "intra_node": {...}, ...}

A field the file lacks, one it has that `Hardware` does not, or a value of the wrong kind is
a ValueError naming the file, the field and the fix: a profile with a silently defaulted
rate would price every plan wrong.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from pathlib import Path

from fxpar.cost.hardware import Hardware, Link
from fxpar.cost.matmul_table import MatmulTable

FORMAT = "fxpar-hardware/1"
_LINKS = ("intra_node", "inter_node")
_TABLES = ("peak_flops", "bandwidths")


def is_profile_file(name: str) -> bool:
    """Whether the hardware `name` names a profile file rather than a built-in profile."""
    return name.endswith(".json")


def save_profile(hardware: Hardware, path: str | Path) -> Path:
    """Write `hardware` to `path` as a profile file (module doc)."""
    fields = dataclasses.asdict(hardware)
    path = Path(path)
    path.write_text(json.dumps({"format": FORMAT, **fields}, indent=1) + "\n")
    return path


def load_profile(path: str | Path) -> Hardware:
    """The Hardware a profile file describes; a ValueError says what is wrong with it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"hardware profile file {str(path)!r} does not exist. Fix: write one with "
                         "`python -m fxpar.cost.calibrate -o FILE.json`, or name a built-in profile") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"hardware profile file {str(path)!r} is not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"hardware profile file {str(path)!r}: format {found!r}, expected {FORMAT!r}. "
                         "Fix: write it again with `python -m fxpar.cost.calibrate -o FILE.json`")
    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    given = {k: v for k, v in data.items() if k != "format"}
    unknown = sorted(set(given) - set(fields))
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = sorted(set(required) - set(given))
    if unknown or missing:
        raise ValueError(f"hardware profile file {str(path)!r}: "
                         + "; ".join(filter(None, [f"unknown fields {unknown}" if unknown else "",
                                                   f"missing fields {missing}" if missing else ""]))
                         + f". Known fields: {', '.join(fields)}")
    for name in _LINKS:
        link = given[name]
        if not (isinstance(link, dict) and {"alpha", "bandwidth"} <= set(link) <= {"alpha", "bandwidth", "wait"}):
            raise ValueError(f"hardware profile file {str(path)!r}: {name} must be "
                             f'{{"alpha": seconds, "bandwidth": bytes per second}} (and optionally '
                             f'"wait": seconds), got {link!r}')
        given[name] = Link(**{k: _number(path, f"{name}.{k}", v) for k, v in link.items()})
    for name, value in given.items():
        if name in _LINKS or name in ("name", "measured", "cores", "host_overlap", "compile_pays", "matmul_tables", *_TABLES) \
                or value is None:
            continue
        given[name] = _number(path, name, value)
    for name in _TABLES:
        if name in given:
            if not isinstance(given[name], dict):
                raise ValueError(f"hardware profile file {str(path)!r}: {name} must map names to numbers, got {given[name]!r}")
            given[name] = {k: _number(path, f"{name}.{k}", v) for k, v in given[name].items()}
    given["matmul_tables"] = {precision: _matmul_table(path, precision, table)
                              for precision, table in given.get("matmul_tables", {}).items()}
    return Hardware(**given)


def _matmul_table(path: Path, precision: str, table) -> MatmulTable:
    points = table.get("points") if isinstance(table, dict) else None
    if not (isinstance(points, list) and points and all(isinstance(p, list) and len(p) == 4 for p in points)):
        raise ValueError(f"hardware profile file {str(path)!r}: matmul_tables.{precision} must be "
                         f'{{"points": [[m, k, n, FLOP/s], ...]}} (at least one), got {table!r}')
    return MatmulTable(tuple(tuple(_number(path, f"matmul_tables.{precision}", v) for v in p) for p in points))


def _number(path: Path, field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise ValueError(f"hardware profile file {str(path)!r}: {field} must be a number >= 0, got {value!r}")
    return value
