"""The plan: which parallelism fxpar applies, as a frozen dataclass of data.

Map of this module:

- `Plan`                      the dataclass: `Plan(dp=2, microbatches=4)`
- `Plan.parse`                from the text form, a dict, a JSON/YAML file, or a `Plan`
- `str(plan)`, `Plan.to_dict`, `Plan.to_json`, `Plan.from_json`   exact round trips
- `Plan.check_world_size`     the plan against the launch (`WORLD_SIZE` from torchrun)
- `Plan.check_batch`          the plan against the global batch
- `PLANNED_KEYS`              keys whose capability arrives in a later version, refused clearly

The text form is what a command line or a config string holds::

    dp=2 mb=4 bucket_mb=25      # entries `key=value`, separated by spaces, commas or both
    dp=2,mb=4                   # `mb` is short for `microbatches`
    ""                          # the default plan: one replica, no gradient accumulation

`str(plan)` writes the canonical form (default-valued fields left out, "dp=1" for the default
plan) and `Plan.parse(str(plan)) == plan`. A JSON or YAML file holds the same keys as a mapping,
`{"dp": 2, "mb": 4}`.

Every mistake raises `PlanError` (a `ValueError`) with `field` and `value` set and a message that
names the field, the value, the rule it broke and a fix. For a malformed entry (`"dp"`, `"=2"`,
`"dp=2=3"`) `field` is the key as written ("plan" when there is none) and `value` is the entry.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from os import PathLike
from pathlib import Path
from typing import Literal

import yaml

from fxpar.errors import PlanError

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")
Precision = Literal["fp32", "bf16-mixed"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed")
ZERO_STAGES = (0, 1, 2, 3)

# field -> (its key in the text form, the rule its value follows, a fix that follows the rule)
_FIELDS: dict[str, tuple[str, str, str]] = {
    "dp": ("dp", "a positive integer (the number of data-parallel replicas)", "dp=2"),
    "microbatches": ("mb", "a positive integer (1 means no gradient accumulation)", "mb=4"),
    "bucket_mb": (
        "bucket_mb",
        "a positive, finite number of MiB (the gradient-bucket size)",
        "bucket_mb=25, or leave bucket_mb out to let the cost model choose",
    ),
    "tp": ("tp", "a positive integer (the tensor-parallel degree)", "tp=2"),
    "pp": ("pp", "a positive integer (the number of pipeline ranks)", "pp=2"),
    "schedule": (
        "schedule",
        "one of " + ", ".join(repr(s) for s in SCHEDULES) + " (the pipeline schedule)",
        "schedule=1f1b",
    ),
    "virtual_stages": (
        "virtual_stages",
        "a positive integer (model chunks per pipeline rank; > 1 with schedule=interleaved)",
        "virtual_stages=2",
    ),
    "split": (
        "split",
        "a list of module paths, each starting a new pipeline stage",
        'split=["h.4","h.8"] (JSON/YAML or Python)',
    ),
    "sequence_parallel": ("sp", "true or false (shard norms and dropout along the sequence)", "sp=true"),
    "tp_rules": (
        "tp_rules",
        "'auto' or a mapping of module-path globs to colwise/rowwise/vocab/replicate",
        'tp_rules={"h.*.attn.q":"colwise","h.*.attn.o":"rowwise"}',
    ),
    "zero": ("zero", "one of 0, 1, 2, 3 (the ZeRO stage: what is sharded over dp)", "zero=1"),
    "precision": (
        "precision",
        "one of " + ", ".join(repr(p) for p in PRECISIONS) + " (how weights and math are stored)",
        "precision=bf16-mixed",
    ),
}
# Keys the text form and mappings accept -> field: the short keys and the field names.
_FIELD_OF_KEY: dict[str, str] = {key: name for name, (key, _, _) in _FIELDS.items()} | {
    name: name for name in _FIELDS
}
_SUPPORTED_KEYS = (
    "dp, tp, pp, sp, tp_rules, schedule, virtual_stages, split, mb (or microbatches), bucket_mb, "
    "zero, precision"
)

# The parallel degrees; their product is the world size. tp and pp join this tuple when they land.
_DEGREE_FIELDS: tuple[str, ...] = ("dp", "pp", "tp")

# Keys a later fxpar version will accept -> what they ask for. Refused, naming the capability.
PLANNED_KEYS: dict[str, str] = {}  # every capability the plan names has landed

_FILE_SUFFIXES = (".json", ".yaml", ".yml")
# A bare word with a file suffix (`plan.toml`, `configs/plan.txt`) is a path, not plan text.
_LOOKS_LIKE_PATH = re.compile(r"[^\s,=]*\.[A-Za-z]\w*")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to parallelise one training step.

    >>> plan = Plan.parse("dp=2 mb=4")
    >>> plan.world_size, str(plan)
    (2, 'dp=2 mb=4')

    Each of the `dp` replicas takes `batch / dp` samples of the global batch and splits them into
    `microbatches` microbatches whose gradients accumulate before one gradient synchronisation.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    # Which modules tensor parallelism splits: "auto" (Megatron's pairs, inferred from the
    # graph) or {module-path glob: style}; see fxpar.passes.tp_rules. A Hugging Face
    # `base_model_tp_plan` dict works as is.
    tp_rules: str | Mapping[str, str] = "auto"
    sequence_parallel: bool = False  # Korthikanti et al. 2022: norms on sequence shards
    # Pipeline: the order of microbatch forwards and backwards (fxpar.schedules), model chunks
    # per rank (Narayanan et al. 2021's interleaving), and optional stage starts by module.
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split: tuple[str, ...] = ()
    microbatches: int = 1
    bucket_mb: float | None = None
    # ZeRO stage (Rajbhandari et al. 2020): 1 shards optimizer state over dp, 2 also gradients,
    # 3 also parameters. The cost model estimates every stage; the runtime runs stage 0 so far.
    zero: int = 0
    # "bf16-mixed": bf16 weights and math, fp32 master weights and optimizer state. Estimated;
    # the runtime trains in fp32 so far.
    precision: Precision = "fp32"

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "virtual_stages", "microbatches"):
            if not _is_positive_int(value := getattr(self, name)):
                raise _invalid_value(name, value)
            object.__setattr__(self, name, int(value))  # numpy ints become ints, for JSON
        if (size := self.bucket_mb) is not None:
            real = isinstance(size, numbers.Real) and not isinstance(size, bool)
            if not (real and math.isfinite(size) and size > 0):
                raise _invalid_value("bucket_mb", size)
            object.__setattr__(self, "bucket_mb", float(size))
        if self.schedule not in SCHEDULES:
            raise _invalid_value("schedule", self.schedule)
        split = self.split
        if isinstance(split, str) or not all(isinstance(m, str) for m in split):
            raise _invalid_value("split", split)
        object.__setattr__(self, "split", tuple(split))
        self._check_pipeline()
        if not isinstance(self.sequence_parallel, bool):
            raise _invalid_value("sequence_parallel", self.sequence_parallel)
        rules = self.tp_rules
        if rules != "auto" and not (
            isinstance(rules, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in rules.items())
        ):
            raise _invalid_value("tp_rules", rules)
        if isinstance(rules, Mapping):
            object.__setattr__(self, "tp_rules", dict(rules))
        if self.sequence_parallel and self.tp == 1:
            raise PlanError(
                "plan field sequence_parallel (sp) needs tensor parallelism: it shards along the "
                "sequence over the tp group, and tp=1. Fix: add tp=2 (or more), or drop sp.",
                field="sequence_parallel",
                value=True,
            )
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise _invalid_value("zero", self.zero)
        object.__setattr__(self, "zero", int(self.zero))
        if self.precision not in PRECISIONS:
            raise _invalid_value("precision", self.precision)

    def _check_pipeline(self) -> None:
        interleaved = self.schedule == "interleaved"
        if interleaved != (self.virtual_stages > 1):
            raise PlanError(
                f"schedule={self.schedule} with virtual_stages={self.virtual_stages}: the "
                "interleaved schedule needs virtual_stages >= 2, and only it uses them. Fix: "
                "schedule=interleaved virtual_stages=2, or virtual_stages=1",
                field="virtual_stages",
                value=self.virtual_stages,
            )
        stages = self.pp * self.virtual_stages
        if self.pp > 1 and self.schedule in ("1f1b", "interleaved") and self.microbatches < self.pp:
            raise PlanError(
                f"schedule={self.schedule} with pp={self.pp} needs at least {self.pp} microbatches "
                f"(one in flight per stage), got mb={self.microbatches}. Fix: mb={self.pp} or "
                f"more (GPipe Sec. 2.3: the bubble is negligible from mb >= 4 pp = {4 * self.pp})",
                field="microbatches",
                value=self.microbatches,
            )
        if interleaved and self.microbatches % self.pp:
            raise PlanError(
                f"the interleaved schedule processes microbatches in groups of pp={self.pp}; "
                f"mb={self.microbatches} is not a multiple. Fix: mb={self.microbatches + self.pp - self.microbatches % self.pp}",
                field="microbatches",
                value=self.microbatches,
            )
        if self.split and len(self.split) != stages - 1:
            raise PlanError(
                f"split names {len(self.split)} stage starts, but pp x virtual_stages = {stages} "
                f"stages need {stages - 1}. Fix: name {stages - 1} module paths",
                field="split",
                value=list(self.split),
            )

    # -- the degrees -----------------------------------------------------------------------------

    @property
    def degrees(self) -> dict[str, int]:
        """The parallel degrees by name, outermost first: `{"dp": 2}`."""
        return {name: getattr(self, name) for name in _DEGREE_FIELDS}

    @property
    def world_size(self) -> int:
        """The number of ranks the plan needs: the product of its parallel degrees."""
        return math.prod(self.degrees.values())

    # -- reading ---------------------------------------------------------------------------------

    @classmethod
    def parse(cls, spec: Plan | str | PathLike[str] | Mapping[str, object]) -> Plan:
        """A plan from its text form, a mapping, a JSON/YAML file, or a `Plan` (returned as is).

        >>> Plan.parse("dp=2, mb=4") == Plan.parse({"dp": 2, "microbatches": 4})
        True

        A `str` ending in .json, .yaml or .yml is read as a path. The text `auto` is refused:
        automatic planning is not available yet.
        """
        if isinstance(spec, Plan):
            return spec
        if isinstance(spec, PathLike):
            return cls._from_file(Path(spec))
        if isinstance(spec, Mapping):
            return cls._from_entries(spec.items())
        if not isinstance(spec, str):
            raise TypeError(f"Plan.parse takes a Plan, text, a mapping or a path, not {spec!r}")
        text = spec.strip()
        if text.lower() == "auto":
            raise PlanError(
                "plan 'auto' asks for automatic planning, which is not available in this fxpar "
                "version yet. Fix: give explicit degrees such as 'dp=2'.",
                field="plan",
                value=spec,
            )
        if text.lower().endswith(_FILE_SUFFIXES) or _LOOKS_LIKE_PATH.fullmatch(text):
            return cls._from_file(Path(text))
        return cls._from_entries(_split_entries(text))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan `to_json` wrote (any JSON object of plan keys works)."""
        mapping = _read_mapping(text, language="JSON", where="plan JSON", source=text)
        return cls._from_entries(mapping.items())

    @classmethod
    def _from_file(cls, path: Path) -> Plan:
        suffix = path.suffix.lower()
        if suffix not in _FILE_SUFFIXES:
            found = f"suffix {suffix!r}" if suffix else "no suffix"
            raise PlanError(
                f"plan file {str(path)!r} has {found}; fxpar reads plan files ending in .json, "
                ".yaml or .yml. Fix: save the plan as JSON or YAML, or pass the text form such "
                "as 'dp=2'.",
                field="plan",
                value=str(path),
            )
        if not path.is_file():
            raise PlanError(
                f"plan file {str(path)!r} does not exist or is not a file (looked for "
                f"{path.resolve()}). Fix: check the path, or pass the text form such as 'dp=2'.",
                field="plan",
                value=str(path),
            )
        language = "JSON" if suffix == ".json" else "YAML"
        where = f"plan file {str(path)!r}"
        text = path.read_text()
        mapping = _read_mapping(text, language=language, where=where, source=str(path))
        try:
            return cls._from_entries(mapping.items())
        except PlanError as error:  # say which file the bad entry is in
            raise PlanError(f"{where}: {error}", field=error.field, value=error.value) from None

    @classmethod
    def _from_entries(cls, entries: Iterable[tuple[object, object]]) -> Plan:
        """The plan from (key, value) pairs; a str value is parsed ("2" -> 2, "0.5" -> 0.5)."""
        values: dict[str, object] = {}
        written: dict[str, str] = {}
        for key, raw in entries:
            key = str(key)
            if key in PLANNED_KEYS:
                raise PlanError(
                    f"plan key {key!r} ({key}={raw}) asks for {PLANNED_KEYS[key]}: this fxpar "
                    f"version does not implement {PLANNED_KEYS[key]} yet. Supported keys: "
                    f"{_SUPPORTED_KEYS}. Fix: remove {key}={raw} from the plan.",
                    field=key,
                    value=raw,
                )
            if key not in _FIELD_OF_KEY:
                raise _unknown_key(key, raw)
            name = _FIELD_OF_KEY[key]
            if name in values:
                raise PlanError(
                    f"plan field {name} is given twice: {written[name]} and {key}={raw}. "
                    "Fix: keep one of them.",
                    field=name,
                    value=raw,
                )
            values[name] = _value_from_text(name, raw) if isinstance(raw, str) else raw
            written[name] = f"{key}={raw}"
        return cls(**values)  # type: ignore[arg-type]  # __post_init__ checks every value

    # -- writing ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        """All fields under their canonical (field) names: `{"dp": 2, "microbatches": 4, ...}`."""
        return asdict(self) | {"split": list(self.split)}

    def to_json(self) -> str:
        """`to_dict` as JSON; `Plan.from_json(plan.to_json()) == plan`."""
        return json.dumps(self.to_dict())

    def __str__(self) -> str:
        """The canonical text form: `dp=2 mb=4`, default-valued fields left out."""
        default = Plan().to_dict()
        entries = [
            f"{_FIELDS[name][0]}={_text(value)}"
            for name, value in self.to_dict().items()
            if value != default[name]
        ]
        return " ".join(entries) or "dp=1"

    # -- checks against the launch and the data --------------------------------------------------

    def check_world_size(self, world_size: int) -> None:
        """Raise `PlanError` unless the plan's degrees multiply to `world_size` (torchrun's)."""
        if not _is_positive_int(world_size):
            raise PlanError(
                f"WORLD_SIZE must be a positive integer, got {world_size!r}. "
                "Fix: launch with torchrun, which sets it.",
                field="world_size",
                value=world_size,
            )
        if world_size == self.world_size:
            return
        degrees = " * ".join(
            f"{name}={value}" for name, value in self.degrees.items() if value > 1 or name == "dp"
        )
        others = self.world_size // self.dp
        example = replace(self, dp=world_size // others) if world_size % others == 0 else replace(
            self, dp=world_size, tp=1
        )
        raise PlanError(
            f"plan degrees multiply to {self.world_size} ({degrees}) but WORLD_SIZE is "
            f"{world_size}. Fix: launch with `torchrun --nproc-per-node {self.world_size} ...` "
            f"or change the plan so the degrees multiply to {world_size} (for example {example}).",
            field="world_size",
            value=world_size,
        )

    def check_batch(self, batch: int) -> None:
        """Raise `PlanError` unless the global `batch` splits evenly into dp * microbatches parts.

        >>> Plan(dp=2, microbatches=4).check_batch(16)  # 2 replicas x 4 microbatches of 2
        """
        if not _is_positive_int(batch):
            raise PlanError(
                f"global batch must be a positive integer, got {batch!r}. "
                "Fix: pass the number of samples in one step, e.g. 32.",
                field="batch",
                value=batch,
            )
        dp, mb = self.dp, self.microbatches
        unit = dp * mb
        if batch % unit == 0:
            return
        below, above = batch // unit * unit, (batch // unit + 1) * unit
        fixes = [f"use a global batch of {f'{below} or {above}' if below else above}"]
        if batch % dp == 0:  # keep dp: the most microbatches that still divide the local batch
            best = max(m for m in range(1, mb + 1) if batch % (dp * m) == 0)
            fixes.append(f"keep the batch and use mb={best}")
        if batch % mb == 0:  # keep mb: the most replicas that still divide the batch
            best = max(d for d in range(1, dp + 1) if batch % (d * mb) == 0)
            fixes.append(f"keep the batch and use dp={best} (and launch that many ranks)")
        raise PlanError(
            f"global batch {batch} is not divisible by dp * microbatches = {dp} * {mb} = {unit}: "
            f"each of the {dp} data-parallel replicas takes batch/dp samples and splits them "
            f"into {mb} equal microbatches. Fix: {', or '.join(fixes)}.",
            field="batch",
            value=batch,
        )


def _text(value: object) -> str:
    """A field's value in the text form: compact JSON for rules, lower-case booleans."""
    if isinstance(value, Mapping):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, (tuple, list)):
        return ";".join(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _split_entries(text: str) -> list[tuple[str, str]]:
    """`"dp=2, mb=4"` -> `[("dp", "2"), ("mb", "4")]`; malformed entries raise `PlanError`."""
    entries = []
    # tp_rules may be written as compact JSON: take it out before splitting on commas.
    rules = re.search(r"tp_rules=(\{[^}]*\})", text)
    if rules:
        entries.append(("tp_rules", rules.group(1)))
        text = text[: rules.start()] + text[rules.end():]
    for entry in re.split(r"[\s,]+", text):
        if not entry:
            continue
        key, equals, value = entry.partition("=")
        if not equals:
            problem, fix = "has no '='", f"write it as {entry}=<value>, e.g. dp=2"
        elif not key:
            problem, fix = "has no key before '='", f"name the field, e.g. dp{entry}"
        elif not value:
            problem, fix = "has no value after '='", f"give one, e.g. {entry}2"
        elif "=" in value:
            problem, fix = "has more than one '='", "separate entries with spaces or commas"
        else:
            entries.append((key, value))
            continue
        raise PlanError(
            f"plan entry {entry!r} {problem}: each entry is key=value, with no spaces around "
            f"'=' (keys: {_SUPPORTED_KEYS}). Fix: {fix}.",
            field=key or "plan",
            value=entry,
        )
    return entries


def _value_from_text(name: str, text: str) -> object:
    """`"2"` -> 2 for integer fields, `"0.5"` -> 0.5 for bucket_mb; anything else raises."""
    if name in ("precision", "schedule"):
        return text
    if name == "split":
        return tuple(m for m in text.split(";") if m)
    if name == "sequence_parallel":
        flags = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if text.strip().lower() in flags:
            return flags[text.strip().lower()]
        raise _invalid_value(name, text)
    if name == "tp_rules":
        if text.strip() == "auto":
            return "auto"
        try:
            rules = json.loads(text)
        except json.JSONDecodeError:
            raise _invalid_value(name, text) from None
        return rules
    if name == "zero" and text.strip() == "0":
        return 0
    if name == "bucket_mb":
        try:
            return float(text)
        except ValueError:
            raise _invalid_value(name, text) from None
    if re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    raise _invalid_value(name, text)


def _is_positive_int(value: object) -> bool:
    """True for 1, 2, ... (numpy integers too); False for bools, floats such as 2.0, and 0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def _invalid_value(name: str, value: object) -> PlanError:
    key, rule, fix = _FIELDS[name]
    called = name if key == name else f"{name} ({key})"
    return PlanError(
        f"plan field {called} must be {rule}; got {value!r}. Fix: write e.g. {fix}.",
        field=name,
        value=value,
    )


def _unknown_key(key: str, value: object) -> PlanError:
    close = difflib.get_close_matches(key.lower(), _FIELD_OF_KEY, n=2)
    hint = f" Did you mean {' or '.join(repr(c) for c in sorted(close))}?" if close else ""
    return PlanError(
        f"unknown plan key {key!r} (in {key}={value}).{hint} Supported keys: {_SUPPORTED_KEYS}. "
        f"Fix: rename or remove {key!r}.",
        field=key,
        value=value,
    )


def _read_mapping(
    text: str, *, language: Literal["JSON", "YAML"], where: str, source: str
) -> Mapping[object, object]:
    """The mapping a JSON or YAML text holds; bad syntax or another kind of value raises.

    `where` starts the error message ("plan file 'p.yaml'"); `source` is the error's `value`.
    """
    try:
        data = json.loads(text) if language == "JSON" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise PlanError(
            f"{where} is not valid {language}. Fix: correct its syntax.\n{error}",
            field="plan",
            value=source,
        ) from None
    if isinstance(data, Mapping):
        return data
    raise PlanError(
        f"{where} holds a {type(data).__name__} ({data!r:.60}), not a mapping of plan keys to "
        'values. Fix: write a mapping such as {"dp": 2, "mb": 4} (in YAML: "dp: 2").',
        field="plan",
        value=source,
    )
