"""How plans are written down: the field table, the text form, and the errors of both.

`fxpar.plan.Plan` is the dataclass; this module reads and writes what users type. Each field
has a key in the text form (`mb` for `microbatches`), the rule its value follows and an example
fix, in one table (`FIELDS`); every message about a bad entry is made from that table.
"""

from __future__ import annotations

import difflib
import json
import numbers
import re
from collections.abc import Mapping
from typing import Literal

import yaml

from fxpar.errors import PlanError

# tp_rules given by name: "auto" (the model's own base-model plan, else inferred), "model" (the
# model's whole declared plan) or "infer" (Megatron's layout inferred from the graph).
TP_RULE_SOURCES = ("auto", "model", "infer")

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved", "zb-h1")  # as fxpar.schedules builds
Precision = Literal["fp32", "bf16-mixed"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed")
ZERO_STAGES = (0, 1, 2, 3)

# field -> (its key in the text form, the rule its value follows, a fix that follows the rule)
FIELDS: dict[str, tuple[str, str, str]] = {
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
        "'auto', 'model', 'infer' or a mapping of module-path globs to colwise/rowwise/vocab/replicate",
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
FIELD_OF_KEY: dict[str, str] = {key: name for name, (key, _, _) in FIELDS.items()} | {
    name: name for name in FIELDS
}
SUPPORTED_KEYS = (
    "dp, tp, pp, sp, tp_rules, schedule, virtual_stages, split, mb (or microbatches), bucket_mb, "
    "zero, precision"
)

# The parallel degrees; their product is the world size. tp and pp join this tuple when they land.
DEGREE_FIELDS: tuple[str, ...] = ("dp", "pp", "tp")

# Keys a later fxpar version will accept -> what they ask for. Refused, naming the capability.

FILE_SUFFIXES = (".json", ".yaml", ".yml")
# A bare word with a file suffix (`plan.toml`, `configs/plan.txt`) is a path, not plan text.
LOOKS_LIKE_PATH = re.compile(r"[^\s,=]*\.[A-Za-z]\w*")


def text_of(value: object) -> str:
    """A field's value in the text form: compact JSON for rules, lower-case booleans."""
    if isinstance(value, Mapping):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, (tuple, list)):
        return ";".join(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def split_entries(text: str) -> list[tuple[str, str]]:
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
            f"'=' (keys: {SUPPORTED_KEYS}). Fix: {fix}.",
            field=key or "plan",
            value=entry,
        )
    return entries


def value_from_text(name: str, text: str) -> object:
    """`"2"` -> 2 for integer fields, `"0.5"` -> 0.5 for bucket_mb; anything else raises."""
    if name in ("precision", "schedule"):
        return text
    if name == "split":
        return tuple(m for m in text.split(";") if m)
    if name == "sequence_parallel":
        flags = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if text.strip().lower() in flags:
            return flags[text.strip().lower()]
        raise invalid_value(name, text)
    if name == "tp_rules":
        if text.strip() in TP_RULE_SOURCES:
            return text.strip()
        try:
            rules = json.loads(text)
        except json.JSONDecodeError:
            raise invalid_value(name, text) from None
        return rules
    if name == "zero" and text.strip() == "0":
        return 0
    if name == "bucket_mb":
        try:
            return float(text)
        except ValueError:
            raise invalid_value(name, text) from None
    if re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    raise invalid_value(name, text)


def is_positive_int(value: object) -> bool:
    """True for 1, 2, ... (numpy integers too); False for bools, floats such as 2.0, and 0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def invalid_value(name: str, value: object) -> PlanError:
    key, rule, fix = FIELDS[name]
    called = name if key == name else f"{name} ({key})"
    return PlanError(
        f"plan field {called} must be {rule}; got {value!r}. Fix: write e.g. {fix}.",
        field=name,
        value=value,
    )


def unknown_key(key: str, value: object) -> PlanError:
    close = difflib.get_close_matches(key.lower(), FIELD_OF_KEY, n=2)
    hint = f" Did you mean {' or '.join(repr(c) for c in sorted(close))}?" if close else ""
    return PlanError(
        f"unknown plan key {key!r} (in {key}={value}).{hint} Supported keys: {SUPPORTED_KEYS}. "
        f"Fix: rename or remove {key!r}.",
        field=key,
        value=value,
    )


def read_mapping(
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
