"""How plans are written down: the field table, the text form, and the errors of both.

`fxpar.plan.plan.Plan` is the dataclass; this module reads and writes what users type. Each field
has a key in the text form (`mb` for `microbatches`), the rule its value follows and an example
fix, in one table (`FIELDS`); every message about a bad entry is made from that table.

A message shows a value at most `errors.SHOWN_CHARACTERS` (80) characters long (`errors.shown`).
With `echo=False` (entries read from a plan file, which may hold anything: `fxpar.plan.file`)
it shows no value at all, only its type and size, so a file's content never reaches a log.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import re
from collections.abc import Mapping
from typing import Literal

from fxpar.errors import PlanError, clipped, shown
from fxpar.schedule.schedules import SCHEDULES  # the names `schedule=` accepts

# tp_rules given by name: "auto" (the model's own base-model plan, else inferred), "model" (the
# model's whole declared plan) or "infer" (Megatron's layout inferred from the graph).
TP_RULE_SOURCES = ("auto", "model", "infer")

Precision = Literal["fp32", "bf16-mixed"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed")
ZERO_STAGES = (0, 1, 2, 3)
REDUCE_DTYPES: tuple[str, ...] = ("fp32", "bf16")  # FSDP2's reduce_dtype, under bf16-mixed
CHECKPOINTS: tuple[str, ...] = ("none", "full", "selective")  # activation checkpointing
RNG_MODES: tuple[str, ...] = ("fast", "exact")  # how ranks draw dropout's randomness
COMPILE_MODES: tuple[str, ...] = ("eager", "inductor")  # how each rank's module runs
LOSSES: tuple[str, ...] = ("full", "chunked")  # the cross entropy over the vocabulary at once or in blocks
DISPATCHES: tuple[str, ...] = ("alltoall", "allgather")  # how ep moves tokens to their experts
# When ZeRO-2/3 reduce-scatter gradients with several microbatches (`fxpar.plan.zero_reduction`).
ZERO_REDUCES: tuple[str, ...] = ("auto", "microbatch", "step")
BOOLEAN_FIELDS = ("sequence_parallel", "reshard_after_forward")
CHOICE_FIELDS = ("precision", "schedule", "reduce_dtype", "checkpoint", "rng", "zero_reduce", "compile", "loss",
                 "dispatch")

# field -> (its key in the text form, the rule its value follows, a fix that follows the rule)
FIELDS: dict[str, tuple[str, str, str]] = {
    "dp": ("dp", "a positive integer (the number of data-parallel replicas)", "dp=2"),
    "microbatches": ("mb", "a positive integer (1 means no gradient accumulation)", "mb=4"),
    "bucket_mb": (
        "bucket_mb",
        "a number of MiB from 1/1024 (one KiB) to 1048576 (one TiB; the gradient-bucket size)",
        "bucket_mb=25, or leave bucket_mb out to let the cost model choose",
    ),
    "tp": ("tp", "a positive integer (the tensor-parallel degree)", "tp=2"),
    "pp": ("pp", "a positive integer (the number of pipeline ranks)", "pp=2"),
    "cp": ("cp", "a positive integer (the context-parallel degree: ranks the sequence is split over)", "cp=2"),
    "ep": ("ep", "a positive integer dividing dp (the expert-parallel degree: dp ranks the experts "
                 "are split over)", "dp=2 ep=2"),
    "dispatch": (
        "dispatch",
        "one of " + ", ".join(repr(d) for d in DISPATCHES)
        + " (how ep moves tokens to their experts: each row to its expert's rank by all-to-all, "
        "or the group's tokens all-gathered, every shape static)",
        "dispatch=alltoall",
    ),
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
    "zero_reduce": (
        "zero_reduce",
        "one of " + ", ".join(repr(r) for r in ZERO_REDUCES)
        + " (when ZeRO-2/3 reduce-scatter gradients: after each microbatch's backward, once "
        "per step, or as the cost model prices cheaper)",
        "zero_reduce=microbatch",
    ),
    "precision": (
        "precision",
        "one of " + ", ".join(repr(p) for p in PRECISIONS) + " (how weights and math are stored)",
        "precision=bf16-mixed",
    ),
    "reduce_dtype": (
        "reduce_dtype",
        "one of " + ", ".join(repr(d) for d in REDUCE_DTYPES)
        + " (the dtype gradients are reduced in under precision=bf16-mixed)",
        "reduce_dtype=fp32",
    ),
    "prefetch": (
        "prefetch",
        "a non-negative integer (how many layers ahead ZeRO-3 gathers parameters; 0: none)",
        "prefetch=1",
    ),
    "reshard_after_forward": (
        "reshard_after_forward",
        "true or false (ZeRO-3 frees gathered parameters after forward and gathers them again "
        "for backward)",
        "reshard_after_forward=true",
    ),
    "checkpoint": (
        "checkpoint",
        "one of " + ", ".join(repr(c) for c in CHECKPOINTS)
        + " (activation checkpointing: none, every transformer block, or attention's core: QK^T, "
        "softmax, dropout, times V)",
        "checkpoint=selective",
    ),
    "rng": (
        "rng",
        "one of " + ", ".join(repr(m) for m in RNG_MODES)
        + " (fast: consistent masks per rank; exact: the masks one device would draw)",
        "rng=exact",
    ),
    "compile": (
        "compile",
        "one of " + ", ".join(repr(m) for m in COMPILE_MODES)
        + " (eager: each rank's graph op by op, the exact reference; inductor: its forward and "
        "backward compiled by torch.compile's Inductor)",
        "compile=eager",
    ),
    "loss": (
        "loss",
        "one of " + ", ".join(repr(m) for m in LOSSES)
        + " (full: the cross entropy over all logits at once; chunked: a block of rows at a "
        "time, never an [N, V] fp32 tensor)",
        "loss=chunked",
    ),
}
# Keys the text form and mappings accept -> field: the short keys and the field names.
FIELD_OF_KEY: dict[str, str] = {key: name for name, (key, _, _) in FIELDS.items()} | {
    name: name for name in FIELDS
}
SUPPORTED_KEYS = (
    "dp, tp, pp, cp, ep, dispatch, sp, tp_rules, schedule, virtual_stages, split, mb (or microbatches), bucket_mb, "
    "zero, zero_reduce, precision, reduce_dtype, prefetch, reshard_after_forward, checkpoint, rng, compile, loss"
)

# The parallel degrees, outermost first as the mesh lays them out; their product is the world size.
DEGREE_FIELDS: tuple[str, ...] = ("dp", "pp", "cp", "tp")

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
            f"plan entry {shown(entry)} {problem}: each entry is key=value, with no spaces around "
            f"'=' (keys: {SUPPORTED_KEYS}). Fix: {clipped(fix)}.",
            field=key or "plan",
            value=entry,
        )
    return entries


def value_from_text(name: str, text: str, *, echo: bool = True) -> object:
    """`"2"` -> 2 for integer fields, `"0.5"` -> 0.5 for bucket_mb; anything else raises
    (`invalid_value`, which shows `text` unless `echo=False`)."""
    if name in CHOICE_FIELDS:
        return text
    if name == "split":
        return tuple(m for m in text.split(";") if m)
    if name in BOOLEAN_FIELDS:
        flags = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if text.strip().lower() in flags:
            return flags[text.strip().lower()]
        raise invalid_value(name, text, echo=echo)
    if name == "tp_rules":
        if text.strip() in TP_RULE_SOURCES:
            return text.strip()
        try:
            rules = json.loads(text)
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise invalid_value(name, text, echo=echo) from None
        return rules
    if name in ("zero", "prefetch") and text.strip() == "0":
        return 0
    if name == "bucket_mb":
        try:
            return float(text)
        except ValueError:
            raise invalid_value(name, text, echo=echo) from None
    if re.fullmatch(r"[+-]?\d{1,18}", text.strip()):  # longer is no degree (int() refuses 4,300 digits)
        return int(text)
    raise invalid_value(name, text, echo=echo)


def is_positive_int(value: object) -> bool:
    """True for 1, 2, ... (numpy integers too); False for bools, floats such as 2.0, and 0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


# The gradient buckets a plan may ask for: one KiB to one TiB. A smaller size only gives the
# smallest tensors (biases, norms) a bucket each, and one under a byte is no bucket at all
# (the bucketing pass would fail on it); a TiB already holds every gradient of any model in
# one bucket, and a size near a float's range has no byte count (1e308 MiB overflows).
MIN_BUCKET_MB, MAX_BUCKET_MB = 1 / 1024, 2**20


def is_bucket_size(value: object) -> bool:
    """True for a real number of MiB in [`MIN_BUCKET_MB`, `MAX_BUCKET_MB`]; False for bools,
    NaN, infinities, and ints too large for a float (`10**400`)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and MIN_BUCKET_MB <= value <= MAX_BUCKET_MB
    except OverflowError:
        return False


class InvalidPlanValue(PlanError):
    """A PlanError about one field's value alone (its type or range), made by `invalid_value`:
    `Plan.from_file` makes it again with `echo=False`."""


def invalid_value(name: str, value: object, *, echo: bool = True) -> InvalidPlanValue:
    key, rule, fix = FIELDS[name]
    called = name if key == name else f"{name} ({key})"
    return InvalidPlanValue(
        f"plan field {called} must be {rule}; got {_shown_or_described(value, echo)}. Fix: "
        f"write e.g. {fix}.",
        field=name,
        value=value,
    )


def unknown_key(key: str, value: object, *, echo: bool = True) -> PlanError:
    named = shown(key)
    close = difflib.get_close_matches(key[:40].lower(), FIELD_OF_KEY, n=2)
    hint = f" Did you mean {' or '.join(repr(c) for c in sorted(close))}?" if close else ""
    entry = f" (in {clipped(f'{key}={value}')})" if echo else ""
    return PlanError(
        f"unknown plan key {named}{entry}.{hint} Supported keys: {SUPPORTED_KEYS}. "
        f"Fix: rename or remove {named}.",
        field=key,
        value=value,
    )


def given_twice(
    name: str, first: tuple[str, object], second: tuple[str, object], *, echo: bool = True
) -> PlanError:
    """Field `name` written under two keys (`mb` and `microbatches`), or one key twice."""
    if echo:
        both = f"{clipped(f'{first[0]}={first[1]}')} and {clipped(f'{second[0]}={second[1]}')}"
    else:
        both = f"as {shown(first[0])} and as {shown(second[0])}"
    return PlanError(
        f"plan field {name} is given twice: {both}. Fix: keep one of them.",
        field=name,
        value=second[1],
    )


def _shown_or_described(value: object, echo: bool) -> str:
    """`shown(value)`, or, without echo, what it is and how big: "a str of 11 characters"."""
    if echo:
        return shown(value)
    kind = type(value).__name__
    if isinstance(value, str):
        return f"a str of {len(value):,} characters (a plan file's values are not shown)"
    if isinstance(value, (list, tuple, dict)):
        return f"a {kind} of {len(value):,} items (a plan file's values are not shown)"
    return f"a value of type {kind} (a plan file's values are not shown)"
