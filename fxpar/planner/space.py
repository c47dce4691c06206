"""The plans `plan="auto"` chooses among: the search space, one candidate at a time.

A candidate is a set of plan fields. The space crosses

    layout          every dp x tp x pp x cp that multiplies to the world size, tp x cp within
                    a node (their collectives sit on every layer's critical path: Megatron's
                    rule, Narayanan et al. 2021 Sec. 3.3, and cp's key and value gathers),
                    cp only where the example's sequence splits into cp equal slices
    ZeRO            0-3 with dp > 1 (with dp = 1 there is nothing to shard over: a stage
                    the caller fixes leaves the dp = 1 layouts out)
    microbatches    without a pipeline 1, 2, 4 (fewer activations per pass, more passes); with
                    one, pp, 2 pp and 4 pp (GPipe Sec. 2.3: the bubble shrinks as mb grows)
    schedule        with a pipeline: 1F1B, GPipe, interleaved 1F1B (two chunks per rank),
                    zero-bubble ZB-H1
    ep              for a mixture of experts, every ep dividing both dp and the experts of a
                    layer
    sp              with tp > 1 and cp = 1, sequence parallelism off and on
    checkpoint      none, selective (attention's core), full (every block)

and keeps the fields the caller fixes (`precision`, `tp_rules`, or a degree: `fixed`) in every
candidate. A candidate whose batch cannot split `dp x mb` ways is left out here; every other
rule (heads divisible by tp, blocks by the stages, ...) is the plan's and the compiler's own,
and the search reports the candidates they refuse with their reasons.

Compiled mode is not crossed with the rest: pricing it partitions each distinct rank module
with Inductor, seconds each, which would multiply a search's time several-fold. Where compiling
pays (`Hardware.compile_pays`: GPUs, not the CPU), the search prices the compiled variant of
its fastest plans (`planner.search.VARIANTS_PRICED`); `fixed="compile=inductor"` (or `eager`)
decides it for every candidate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import sympy

from fxpar.plan.plan import Plan
from fxpar.schedule.schedules import SCHEDULES

STEPS_PER_STAGE = (1, 2, 4)  # pipeline microbatches as multiples of pp
MICROBATCHES = (1, 2, 4)  # without a pipeline
CHECKPOINTS = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the search may choose: the world, the batch it splits, and the fixed fields."""

    world_size: int
    devices_per_node: int  # tp stays within one node
    batch: int  # the global batch, in sequences
    fixed: Mapping[str, object] = field(default_factory=dict)  # plan fields every candidate keeps
    sequence: int | None = None  # the example's sequence length; None: cp stays 1
    experts: int | None = None  # experts of each mixture-of-experts layer; None: ep stays 1

    def __post_init__(self) -> None:
        Plan(**self.fixed)  # an invalid fixed field is the caller's PlanError, named as such

    def layouts(self) -> list[tuple[int, int, int, int]]:
        """Every (dp, tp, pp, cp) whose product is the world size, tp x cp within a node, cp
        dividing the sequence, and each matching the degrees the caller fixed."""
        found = []
        for tp in divisors(self.world_size):
            for cp in divisors(self.world_size // tp):
                for pp in divisors(self.world_size // (tp * cp)):
                    dp = self.world_size // (tp * cp * pp)
                    degrees = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
                    if tp * cp <= self.devices_per_node and self._splits(cp) \
                            and all(self.fixed.get(k, v) == v for k, v in degrees.items()):
                        found.append((dp, tp, pp, cp))
        return found

    def _splits(self, cp: int) -> bool:
        """Whether the sequence splits into `cp` slices (cp = 1 always)."""
        return cp == 1 or (self.sequence is not None and self.sequence % cp == 0)

    def _expert_degrees(self, dp: int) -> tuple[int, ...]:
        """The ep a layout with `dp` data-parallel ranks may take: divisors of both dp and the
        experts of a layer (1 alone for a model without experts)."""
        return tuple(divisors(math.gcd(dp, self.experts))) if self.experts else (1,)

    def candidates(self) -> Iterator[dict[str, object]]:
        """The plan fields of every candidate, layouts in `layouts` order."""
        for dp, tp, pp, cp in self.layouts():
            options = {
                "ep": self._expert_degrees(dp),
                "zero": (0, 1, 2, 3) if dp > 1 else (0,),
                "microbatches": tuple(pp * k for k in STEPS_PER_STAGE) if pp > 1 else MICROBATCHES,
                "schedule": SCHEDULES if pp > 1 else ("1f1b",),
                "sequence_parallel": (False, True) if tp > 1 and cp == 1 else (False,),
                "checkpoint": CHECKPOINTS,
            }
            options = {k: (self.fixed[k],) if k in self.fixed else v for k, v in options.items()}
            for values in itertools.product(*options.values()):
                fields = {**self.fixed, "dp": dp, "tp": tp, "pp": pp, "cp": cp, **dict(zip(options, values))}
                if self.batch % (dp * fields["microbatches"]) or (fields["zero"] and dp == 1):
                    continue  # the batch does not split; ZeRO with nothing to shard over
                if fields["schedule"] == "interleaved":
                    fields["virtual_stages"] = 2
                yield fields


def memory_trade(fields: Mapping[str, object]) -> tuple[tuple, tuple[int, ...]]:
    """A candidate split into what its time depends on and the options that only trade time
    for memory, as ranks (higher saves more, costs more): recomputation, and without a
    pipeline the microbatch count (more passes of less work; with one, microbatches also
    shrink the bubble). Of two candidates with the same first part, one whose ranks are all
    at most the other's is at least as fast: the cost model adds recomputation's forward
    and each microbatch's op overheads and exposed collectives, and takes nothing away."""
    pipelined = fields["pp"] > 1
    traded = {"checkpoint": CHECKPOINTS.index(fields["checkpoint"])}
    if not pipelined:
        traded["microbatches"] = fields["microbatches"]
    rest = tuple(sorted((k, repr(v)) for k, v in fields.items() if k not in traded))
    return rest, tuple(traded.values())


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending."""
    return [int(d) for d in sympy.divisors(n)]
