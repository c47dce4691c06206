"""The plan: which parallelism fxpar applies, as a frozen dataclass of data.

Map of this module:

- `Plan`                      the dataclass: `Plan(dp=2, microbatches=4)`
- `Plan.parse`                from the text form, a dict, a JSON/YAML file, or a `Plan`
- `Plan.from_file`            from a JSON/YAML file, read as untrusted input (`fxpar.plan.file`)
- `str(plan)`, `Plan.to_dict`, `Plan.to_json`, `Plan.from_json`   exact round trips
- `Plan.check_world_size`     the plan against the launch (`WORLD_SIZE` from torchrun)
- `Plan.check_batch`          the plan against the global batch
- `Plan.check_sequence`       the plan against a sequence length (sequence parallelism)
- `Plan.for_world`            the valid plans like this one for another world size
- `fxpar.plan.text`          the field table and the text form, with their errors
- `fxpar.plan.combinations`  the fields against each other (options that need another setting,
                              compiled mode, the pipeline's schedule)
- `fxpar.plan.file`          plan files read as untrusted input (size cap, no repeated keys or
                              YAML aliases, nothing of the file echoed)

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
A message shows at most 80 characters of any value, and none of a plan file's.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from os import PathLike
from pathlib import Path

from fxpar.errors import PlanError, shown
from fxpar.plan.combinations import check_options_apply, check_pipeline
from fxpar.plan.file import FILE_SUFFIXES, describe_file, parse_mapping, read_plan_file
from fxpar.plan.text import (  # noqa: F401  (SCHEDULES, PRECISIONS are part of this API)
    DEGREE_FIELDS,
    FIELD_OF_KEY,
    FIELDS,
    LOOKS_LIKE_PATH,
    CHECKPOINTS,
    COMPILE_MODES,
    DISPATCHES,
    LOSSES,
    PRECISIONS,
    REDUCE_DTYPES,
    RNG_MODES,
    SCHEDULES,
    TP_RULE_SOURCES,
    ZERO_STAGES,
    ZERO_REDUCES,
    InvalidPlanValue,
    Precision,
    given_twice,
    invalid_value,
    is_bucket_size,
    is_positive_int,
    split_entries,
    text_of,
    unknown_key,
    value_from_text,
)


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
    # Context parallelism: the sequence split over `cp` ranks for the whole model, attention
    # over the keys and values gathered from all of them (`fxpar.passes.context_parallel`).
    cp: int = 1
    # Expert parallelism: each mixture-of-experts layer's experts split over `ep` of the dp
    # ranks, which hand each other their tokens (`fxpar.passes.expert_parallel`); ep divides dp.
    ep: int = 1
    # How ep moves tokens (Megatron-Core's token dispatchers): "alltoall" sends each routed
    # row to its expert's rank and back, sized by the router; "allgather" gathers the expert
    # group's tokens to every rank, every shape static (`fxpar.passes.expert_parallel`).
    dispatch: str = "alltoall"
    # Which modules tensor parallelism splits: "auto" (a Hugging Face model's own base-model
    # plan, else Megatron's pairs inferred from the graph), "model" (the model's whole
    # declared plan, its head's included), "infer" (Megatron's pairs inferred from the graph)
    # or {module-path glob: style}; see fxpar.passes.tensor_parallel.rules. A Hugging Face
    # `base_model_tp_plan` dict works as is.
    tp_rules: str | Mapping[str, str] = "auto"
    sequence_parallel: bool = False  # Korthikanti et al. 2022: norms on sequence shards
    # Pipeline: the order of microbatch forwards and backwards (fxpar.schedule.schedules; "zb-h1" splits
    # each backward, Qi et al. 2024), model chunks per rank (Narayanan et al. 2021's
    # interleaving), and optional stage starts by module.
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split: tuple[str, ...] = ()
    microbatches: int = 1
    bucket_mb: float | None = None
    # ZeRO stage (Rajbhandari et al. 2020): 1 shards optimizer state over dp, 2 also gradients,
    # 3 also parameters (passes.zero3: each layer gathered by one graph op before use).
    zero: int = 0
    # ZeRO-2/3 with several microbatches: reduce-scatter each microbatch's gradients after its
    # backward (only the shards accumulate) or the step's sum once (the whole gradients
    # accumulate); "auto" takes what the cost model prices cheaper (`fxpar.plan.zero_reduction`).
    zero_reduce: str = "auto"
    # ZeRO-3 only (FSDP2's options and defaults): how many layers ahead parameters are
    # gathered (None: FSDP2's 1; at most 1 under compile=inductor), and whether the gathered
    # parameters are freed after forward and gathered again for backward (every layer's but
    # the root's, as FSDP2's default).
    prefetch: int | None = None
    reshard_after_forward: bool = True
    # "bf16-mixed": bf16 weights and math, fp32 master weights and optimizer state; gradients
    # are reduced over dp in `reduce_dtype` (passes.mixed_precision, runtime.state.master_weights).
    precision: Precision = "fp32"
    reduce_dtype: str = "fp32"
    # Activation checkpointing (Korthikanti et al. 2022): "full" recomputes every transformer
    # block in backward, "selective" only attention's core (`fxpar.ir.recompute_regions`).
    checkpoint: str = "none"
    # Dropout's randomness: "fast" draws per rank from one seed, consistently where the math
    # needs it (Megatron's RNG tracker); "exact" draws the values one device draws.
    rng: str = "fast"
    # How each rank's module runs: "eager" op by op (the exact reference), "inductor" compiled,
    # forward and backward, by torch.compile (`fxpar.runtime.compiled_forward`).
    compile: str = "eager"
    # The cross entropy over the vocabulary: "full" as the model wrote it, "chunked" a block of
    # rows at a time, never an [N, V] fp32 tensor (`fxpar.passes.chunked_loss`).
    loss: str = "full"

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "cp", "ep", "virtual_stages", "microbatches"):
            if not is_positive_int(value := getattr(self, name)):
                raise invalid_value(name, value)
            object.__setattr__(self, name, int(value))  # numpy ints become ints, for JSON
        if (size := self.bucket_mb) is not None:
            if not is_bucket_size(size):
                raise invalid_value("bucket_mb", size)
            object.__setattr__(self, "bucket_mb", float(size))
        if self.schedule not in SCHEDULES:
            raise invalid_value("schedule", self.schedule)
        split = self.split
        if not isinstance(split, (tuple, list)) or not all(isinstance(m, str) for m in split):
            raise invalid_value("split", split)
        object.__setattr__(self, "split", tuple(split))
        check_pipeline(self)
        if not isinstance(self.sequence_parallel, bool):
            raise invalid_value("sequence_parallel", self.sequence_parallel)
        rules = self.tp_rules
        if rules not in TP_RULE_SOURCES and not (
            isinstance(rules, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in rules.items())
        ):
            raise invalid_value("tp_rules", rules)
        if isinstance(rules, Mapping):
            object.__setattr__(self, "tp_rules", dict(rules))
        if self.sequence_parallel and self.tp == 1:
            raise PlanError(
                "plan field sequence_parallel (sp) needs tensor parallelism: it shards along the "
                "sequence over the tp group, and tp=1. Fix: add tp=2 (or more), or drop sp.",
                field="sequence_parallel",
                value=True,
            )
        zero = self.zero
        if isinstance(zero, bool) or not isinstance(zero, numbers.Integral) or zero not in ZERO_STAGES:
            raise invalid_value("zero", self.zero)
        object.__setattr__(self, "zero", int(self.zero))
        for name, accepted in (
            ("precision", PRECISIONS),
            ("reduce_dtype", REDUCE_DTYPES),
            ("checkpoint", CHECKPOINTS),
            ("rng", RNG_MODES),
            ("compile", COMPILE_MODES),
            ("loss", LOSSES),
            ("dispatch", DISPATCHES),
            ("zero_reduce", ZERO_REDUCES),
        ):
            if getattr(self, name) not in accepted:
                raise invalid_value(name, getattr(self, name))
        prefetch = self.prefetch
        if prefetch is not None:
            if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch < 0:
                raise invalid_value("prefetch", prefetch)
            object.__setattr__(self, "prefetch", int(prefetch))
        if not isinstance(self.reshard_after_forward, bool):
            raise invalid_value("reshard_after_forward", self.reshard_after_forward)
        check_options_apply(self)

    @property
    def gathers_ahead(self) -> int:
        """How many layers ahead ZeRO-3 gathers: the plan's `prefetch`, else FSDP2's 1 (the
        runtime's gatherer in eager mode, `runtime.collective_schedule` in a compiled graph)."""
        return 1 if self.prefetch is None else self.prefetch

    # -- the degrees -----------------------------------------------------------------------------

    @property
    def degrees(self) -> dict[str, int]:
        """The parallel degrees by name, outermost first: `{"dp": 2}`."""
        return {name: getattr(self, name) for name in DEGREE_FIELDS}

    @property
    def world_size(self) -> int:
        """The number of ranks the plan needs: the product of its parallel degrees."""
        return math.prod(self.degrees.values())

    @property
    def compute_precision(self) -> str:
        """What matmuls run in: "bf16" under bf16-mixed, else "fp32" (the cost model's key)."""
        return "bf16" if self.precision == "bf16-mixed" else "fp32"

    # -- reading ---------------------------------------------------------------------------------

    @classmethod
    def parse(cls, spec: Plan | str | PathLike[str] | Mapping[str, object]) -> Plan:
        """A plan from its text form, a mapping, a JSON/YAML file, or a `Plan` (returned as is).

        >>> Plan.parse("dp=2, mb=4") == Plan.parse({"dp": 2, "microbatches": 4})
        True

        A path (`os.PathLike`) is read with `from_file`, and so is a `str` that looks like one
        (it ends in .json, .yaml or .yml, or is one word with a suffix, such as `plan.toml`),
        which is refused unless it names an existing plan file: nothing else is ever read. The
        text `auto` is refused: it asks for a search (`fxpar.plan_auto`), not one plan.
        """
        if isinstance(spec, Plan):
            return spec
        if isinstance(spec, PathLike):
            return cls.from_file(spec)
        if isinstance(spec, Mapping):
            return cls._from_entries(spec.items())
        if not isinstance(spec, str):
            raise TypeError(
                f"Plan.parse takes a Plan, text, a mapping or a path, not a "
                f"{type(spec).__name__} ({shown(spec)})"
            )
        text = spec.strip()
        if text.lower() == "auto":
            raise PlanError(
                "plan 'auto' is not one plan but a search for one, which needs the model, its "
                "example batch and the world size. Fix: fxpar.compile(model, 'auto', inputs, "
                "world_size=N) compiles the plan the search chooses; fxpar.plan_auto(model, "
                "inputs, world_size=N) shows the ranking",
                field="plan",
                value=spec,
            )
        if text.lower().endswith(FILE_SUFFIXES) or LOOKS_LIKE_PATH.fullmatch(text):
            return cls.from_file(text)
        return cls._from_entries(split_entries(text))

    @classmethod
    def fields_given(cls, spec: str | Mapping[str, object]) -> dict[str, object]:
        """The fields `spec` sets, checked as `parse` checks them, by field name:
        `"precision=bf16-mixed, sp=true"` -> `{"precision": "bf16-mixed", "sequence_parallel":
        True}`. A default written out counts as given (the planner keeps every given field)."""
        entries = list(spec.items()) if isinstance(spec, Mapping) else split_entries(spec)
        plan = cls._from_entries(entries)
        names = [FIELD_OF_KEY[str(key)] for key, _ in entries]
        return {name: getattr(plan, name) for name in names}

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan `to_json` wrote (any JSON object of plan keys works)."""
        mapping = parse_mapping(text, language="JSON", where="plan JSON", value=text)
        return cls._from_entries(mapping.items())

    @classmethod
    def from_file(cls, path: str | PathLike[str]) -> Plan:
        """The plan a JSON (.json) or YAML (.yaml, .yml) file holds: a mapping of plan keys.

            Plan.from_file("plan.yaml")    # plan.yaml holds two lines, "dp: 2" and "mb: 4"

        The file is untrusted input (`fxpar.plan.file`): at most 1 MiB of UTF-8 is read, a key
        given twice and YAML anchors or aliases are refused, and an error names the file, the
        key and the rule, never a value the file holds.
        """
        path = Path(path)
        mapping, _ = read_plan_file(path)
        try:
            return cls._from_entries(mapping.items(), echo=False)
        except PlanError as error:  # say which file the bad entry is in
            if isinstance(error, InvalidPlanValue):  # made again without the file's value
                error = invalid_value(error.field, error.value, echo=False)
            where = describe_file(path)
            raise PlanError(f"{where}: {error}", field=error.field, value=error.value) from None

    @classmethod
    def _from_entries(cls, entries: Iterable[tuple[object, object]], *, echo: bool = True) -> Plan:
        """The plan from (key, value) pairs; a str value is parsed ("2" -> 2, "0.5" -> 0.5).

        With `echo=False` (a file's entries) messages name keys but show no value."""
        values: dict[str, object] = {}
        written: dict[str, tuple[str, object]] = {}
        for key, raw in entries:
            key = str(key)
            if key not in FIELD_OF_KEY:
                raise unknown_key(key, raw, echo=echo)
            name = FIELD_OF_KEY[key]
            if name in values:
                raise given_twice(name, written[name], (key, raw), echo=echo)
            values[name] = value_from_text(name, raw, echo=echo) if isinstance(raw, str) else raw
            written[name] = (key, raw)
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
            f"{FIELDS[name][0]}={text_of(value)}"
            for name, value in self.to_dict().items()
            if value != default[name]
        ]
        return " ".join(entries) or "dp=1"

    # -- checks against the launch and the data, and the plans that fit another world ----------

    def check_world_size(self, world_size: int) -> None:
        """Raise `PlanError` unless the plan's degrees multiply to `world_size` (torchrun's).

        The message suggests plans that do (`for_world`).
        """
        if not is_positive_int(world_size):
            raise PlanError(
                f"WORLD_SIZE must be a positive integer, got {shown(world_size)}. "
                "Fix: launch with torchrun, which sets it.",
                field="world_size",
                value=world_size,
            )
        if world_size == self.world_size:
            return
        degrees = " * ".join(
            f"{name}={value}" for name, value in self.degrees.items() if value > 1 or name == "dp"
        )
        examples = ", or ".join(str(p) for p in self.for_world(world_size))
        raise PlanError(
            f"plan degrees multiply to {self.world_size} ({degrees}) but WORLD_SIZE is "
            f"{world_size}. Fix: launch with `torchrun --nproc-per-node {self.world_size} ...` "
            f"or change the plan so the degrees multiply to {world_size} (for example {examples}).",
            field="world_size",
            value=world_size,
        )

    def check_batch(self, batch: int) -> None:
        """Raise `PlanError` unless the global `batch` splits evenly into dp * microbatches parts;
        the message names the nearest batches that do, and the mb or dp that fits this one."""
        if not is_positive_int(batch):
            raise PlanError(
                f"global batch must be a positive integer, got {shown(batch)}. "
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
            best = max(m for m in range(1, min(mb, batch) + 1) if batch % (dp * m) == 0)
            fixes.append(f"keep the batch and use mb={best}")
        if batch % mb == 0:  # keep mb: the most replicas that still divide the batch
            best = max(d for d in range(1, min(dp, batch) + 1) if batch % (d * mb) == 0)
            fixes.append(f"keep the batch and use dp={best} (and launch that many ranks)")
        raise PlanError(
            f"global batch {batch} is not divisible by dp * microbatches = {dp} * {mb} = {unit}: "
            f"each of the {dp} data-parallel replicas takes batch/dp samples and splits them "
            f"into {mb} equal microbatches. Fix: {', or '.join(fixes)}.",
            field="batch",
            value=batch,
        )

    def check_sequence(self, length: int, *, what: str = "the sequence length") -> None:
        """Raise `PlanError` when sequence parallelism cannot split `length` tokens over tp, or
        context parallelism over cp; `what` names the length in the message ("the example's
        sequence length")."""
        for field, key, axis, degree in (("sequence_parallel", "sp=true", "tp", self.tp if self.sequence_parallel else 1),
                                         ("cp", f"cp={self.cp}", "cp", self.cp)):
            if length % degree == 0:
                continue
            fits = [n for n in (length - length % degree, length + degree - length % degree) if n > 0]
            raise PlanError(
                f"plan {key} shards the sequence over {axis}={degree} ranks, and {what} {length} is "
                f"not divisible by {degree}. Fix: use sequences of {' or '.join(map(str, fits))} "
                f"tokens (a multiple of {degree}), or {'sp=false' if field == 'sequence_parallel' else 'cp=1'}",
                field=field,
                value=getattr(self, field),
            )

    def for_world(self, world_size: int) -> list[Plan]:
        """Valid plans like this one whose degrees multiply to `world_size`: the fixes
        `check_world_size` suggests.

        >>> [str(p) for p in Plan(dp=4).for_world(2)]
        ['dp=2']
        >>> [str(p) for p in Plan(pp=2, tp=2, microbatches=2).for_world(2)]
        ['tp=2 mb=2', 'pp=2 mb=2']

        The tensor-parallel degree is kept first (it is tied to the model's head counts), then the
        pipeline's, and the data-parallel degree takes up the rest. When dp alone absorbs the change
        one plan is given, otherwise two to choose between. Fields tied to a degree are adjusted so
        that each suggestion is valid (`_with_degrees`)."""
        triples = [(dp, pp, world_size // (dp * pp)) for dp in _divisors(world_size)
                   for pp in _divisors(world_size // dp)]

        def distance(triple: tuple[int, int, int]) -> tuple:
            dp, pp, tp = triple
            return (tp != self.tp, pp != self.pp, abs(math.log(tp / self.tp)),
                    abs(math.log(pp / self.pp)), abs(math.log(dp / self.dp)))

        found: list[Plan] = []
        for dp, pp, tp in sorted(triples, key=distance):
            candidate = self._with_degrees(dp=dp, pp=pp, tp=tp)
            if candidate is not None and candidate not in found:
                found.append(candidate)
        # found is never empty: dp=world_size with pp=tp=1 is always a valid plan.
        dp_alone = (found[0].tp, found[0].pp) == (self.tp, self.pp)
        return found[:1] if dp_alone else found[:2]

    def _with_degrees(self, *, dp: int, pp: int, tp: int) -> Plan | None:
        """This plan with these degrees and the fields tied to them adjusted; None if still invalid.

        A `split` names stage starts for one number of stages (dropped when pp changes), sequence
        parallelism needs tp > 1, the interleaved schedule pp > 1, and a pipeline schedule other
        than GPipe at least pp microbatches (interleaved: a multiple of pp).
        """
        changes: dict[str, object] = {"dp": dp, "pp": pp, "tp": tp}
        if tp == 1:
            changes["sequence_parallel"] = False
        if pp != self.pp:
            changes["split"] = ()
        if pp == 1 and self.schedule == "interleaved":
            changes |= {"schedule": "1f1b", "virtual_stages": 1}
        microbatches = self.microbatches
        if pp > 1 and self.schedule != "gpipe":
            microbatches = max(microbatches, pp)
        if pp > 1 and self.schedule == "interleaved":
            microbatches = -(-microbatches // pp) * pp
        try:
            return replace(self, **changes, microbatches=microbatches)
        except PlanError:
            return None


def _divisors(n: int) -> list[int]:
    """The divisors of `n`, in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
