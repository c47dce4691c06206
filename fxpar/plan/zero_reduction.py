"""When ZeRO-2 and 3 reduce-scatter gradients under gradient accumulation: per microbatch or per step.

With several microbatches a ZeRO-2/3 step can reduce-scatter each microbatch's gradients
right after its backward and keep only the reduced shards, in which the microbatches' sum
accumulates (DeepSpeed's ZeRO-2, FSDP's default), or let the whole gradients accumulate over
the step's backwards and reduce-scatter their sum once (FSDP2 with
`set_requires_gradient_sync(False)` on all but the last microbatch; Megatron's distributed
optimizer):

                     reduce-scatters per step    whole gradients (4P fp32, 2P bf16)
    "microbatch"     microbatches x P            while one microbatch's backward runs
    "step"           1 x P                       from the first backward to the step's end,
                                                 beside the later microbatches' activations

The plan's `zero_reduce` names one, or "auto" lets the cost model choose. The two modes do
the same compute and differ only in when the reductions go out and what lives meanwhile, so
the program's exposed communication is priced both ways (`cost.estimate.exposed_comm_seconds`,
the estimate's `time.comm_exposed`, on the hardware profile compile priced the cut and the
buckets with, its nominal constants, so every rank decides alike). The step reduces per
microbatch when that exposes at most `TIE` of the step's compute more than per step does (its
extra reductions hide under the backwards, as on GPUs, where NCCL runs beside the compute),
since it never holds more memory; otherwise per step, the fewer bytes on the wire
(always on the CPU, where gloo's thread and the compute share the cores and nothing hides:
`cost.hardware.Hardware.comm_overlap`; measured there, per microbatch takes 1.25x per step's
time at mb=4: benchmarks/RESULTS.md). A step of one microbatch reduces once either way. A
compiled ZeRO-3 step reduces per microbatch: its backward graph reduce-scatters each layer's
gradients where it computes them (`fxpar.ops.recomputed_gathers`).

Where it shows: the step program lists the reductions where they happen (`fxpar.compiler.reduction_lowering`:
each microbatch's bucket reduce-scatters after its backward, or ZeRO-3's layer reduce-scatters
only in the last backward), so the check, the estimate's bytes and the runtime follow it; the
estimate's peak counts the whole gradients when they live all step (`cost.memory.peak_bytes`);
`fxpar explain` prints the decision.

Under the zero-bubble schedule ZeRO-2 reduces per step: a later microbatch's B (bias and norm
gradients) runs before an earlier one's W (weight gradients), so no point of the step holds
exactly one microbatch's gradients (`zero_reduce=microbatch` is a PlanError there; ZeRO-3
refuses zb-h1 altogether, `passes.zero3`).

A ZeRO-2 bucket that waits for a step-end sum (`Bucket.held`: a replicated parameter's partial
tp gradient, a tied parameter's) is reduced once per step in either mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["microbatch", "step"]
TIE = 0.01  # extra exposed time, as a share of the step's compute, that counts as none


@dataclass(frozen=True)
class ZeroReduction:
    """When this program's ZeRO-2/3 gradients are reduce-scattered, and why."""

    mode: Mode
    reason: str  # "the plan's zero_reduce", "one microbatch", or the cost model's comparison
    # Auto only: each mode's predicted exposed communication seconds a step.
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def per_microbatch(self) -> bool:
        """Whether each microbatch's gradients are reduce-scattered after its backward (only
        ever with ZeRO-2/3 over dp > 1: `fixed` says "step" for everything else)."""
        return self.mode == "microbatch"

    def __str__(self) -> str:
        return f"gradients reduce-scattered per {self.mode}: {self.reason}"


def decide(seconds: dict[str, float], *, compute: float, hardware: str) -> ZeroReduction:
    """The cost model's choice from each mode's exposed communication seconds and the step's
    compute seconds (module doc)."""
    each, once = seconds["microbatch"], seconds["step"]
    shown = (f"exposed communication on {hardware}: per microbatch {each * 1e3:.3g} ms, per step "
             f"{once * 1e3:.3g} ms, beside {compute * 1e3:.3g} ms of compute")
    if each - once <= TIE * compute:
        why = f"its extra reductions hide under the backwards, and the whole gradients do not live all step ({shown})"
        return ZeroReduction("microbatch", why, dict(seconds))
    return ZeroReduction("step", f"fewer bytes on the wire ({shown})", dict(seconds))


def fixed(plan) -> ZeroReduction | None:
    """The mode when no pricing is needed: the plan names it, or the step has one microbatch
    (or nothing is reduce-scattered); None when the cost model must choose."""
    if plan.zero_reduce != "auto":
        return ZeroReduction(plan.zero_reduce, "the plan's zero_reduce")
    if plan.zero not in (2, 3) or plan.dp == 1:
        return ZeroReduction("step", "no ZeRO-2/3 reduce-scatters")
    if plan.microbatches == 1:
        return ZeroReduction("step", "one microbatch: reduced once either way")
    if plan.zero == 3 and plan.compile == "inductor":
        return ZeroReduction("microbatch", "a compiled backward reduce-scatters each layer's gradients as it computes them")
    if plan.zero == 2 and plan.schedule == "zb-h1" and plan.pp > 1:
        return ZeroReduction("step", "zb-h1 runs a later microbatch's B before an earlier one's W")
    return None
