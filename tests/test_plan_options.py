"""Plan options that belong to one setting (ZeRO-3's, bf16-mixed's) and degrees far too big:
refused with the field and a fix, and at once."""

from __future__ import annotations

import time

import pytest

from fxpar.errors import PlanError
from fxpar.plan.plan import Plan


def test_options_of_one_setting_are_refused_without_it() -> None:
    """ZeRO-3's and bf16-mixed's options name the setting they need: never silently ignored."""
    with pytest.raises(PlanError, match="add zero=3") as caught:
        Plan.parse("dp=2 zero=2 prefetch=2")
    assert caught.value.field == "prefetch"
    with pytest.raises(PlanError, match="add zero=3"):
        Plan.parse("dp=2 reshard_after_forward=false")
    with pytest.raises(PlanError, match="add precision=bf16-mixed") as caught:
        Plan.parse("reduce_dtype=bf16")
    assert caught.value.field == "reduce_dtype"
    plan = Plan.parse("dp=2 zero=3 prefetch=2 reshard_after_forward=false precision=bf16-mixed "
                      "reduce_dtype=bf16 checkpoint=selective rng=exact")
    assert Plan.parse(str(plan)) == plan and plan.prefetch == 2


@pytest.mark.parametrize("entry", ["checkpoint=partial", "rng=slow", "reduce_dtype=fp16", "prefetch=-1",
                                   "reshard_after_forward=maybe"])
def test_option_values_are_checked(entry: str) -> None:
    key = entry.partition("=")[0]
    with pytest.raises(PlanError, match=f"plan field {key} must be") as caught:
        Plan.parse(entry)
    assert caught.value.field == key


@pytest.mark.parametrize("plan", ["dp=1000000000000", "dp=8 mb=1000000000000"])
def test_huge_degrees_are_refused_at_once(plan: str) -> None:
    """The fixes a batch error suggests are searched among divisors of the batch, not up to
    the degree: a 10^12-way plan fails in microseconds, not hours."""
    started = time.perf_counter()
    with pytest.raises(PlanError, match="is not divisible by dp \\* microbatches"):
        Plan.parse(plan).check_batch(8)
    assert time.perf_counter() - started < 1.0
