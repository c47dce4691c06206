"""Plan: every way in (text, dict, JSON/YAML files), every way out, the checks and every error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fxpar.errors import PlanError
from fxpar.plan.plan import Plan


# -- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "dp=2 mb=4 bucket_mb=0.5",
        "dp=2,mb=4,bucket_mb=0.5",
        "dp=2, mb=4 ,bucket_mb=0.5",
        "  dp=2\tmb=4\nbucket_mb=0.5  ",
        "dp=2 microbatches=4 bucket_mb=0.5",
        "bucket_mb=0.5 mb=4 dp=2",
        ",dp=2,,mb=4, bucket_mb=.5,",
    ],
)
def test_parse_text_with_spaces_commas_and_both(text: str) -> None:
    assert Plan.parse(text) == Plan(dp=2, microbatches=4, bucket_mb=0.5)


def test_parse_text_values_are_typed() -> None:
    plan = Plan.parse("dp=2 mb=4 bucket_mb=25")
    assert type(plan.dp) is int and type(plan.microbatches) is int
    assert type(plan.bucket_mb) is float and plan.bucket_mb == 25.0


@pytest.mark.parametrize("text", ["", "   ", ",", " , "])
def test_parse_empty_text_is_the_default_plan(text: str) -> None:
    assert Plan.parse(text) == Plan()
    assert Plan() == Plan(dp=1, microbatches=1, bucket_mb=None)


def test_parse_dict_with_either_key_and_str_or_native_values() -> None:
    expected = Plan(dp=2, microbatches=4, bucket_mb=0.5)
    assert Plan.parse({"dp": 2, "mb": 4, "bucket_mb": 0.5}) == expected
    assert Plan.parse({"dp": 2, "microbatches": 4, "bucket_mb": 0.5}) == expected
    assert Plan.parse({"dp": "2", "mb": "4", "bucket_mb": "0.5"}) == expected
    assert Plan.parse({"dp": 2, "bucket_mb": None}) == Plan(dp=2)
    assert Plan.parse({}) == Plan()


def test_parse_json_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"dp": 4, "mb": 2, "bucket_mb": 1.5}))
    expected = Plan(dp=4, microbatches=2, bucket_mb=1.5)
    assert Plan.parse(path) == expected
    assert Plan.parse(str(path)) == expected


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".YAML"])
def test_parse_yaml_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"plan{suffix}"
    path.write_text("dp: 2\nmicrobatches: 8\n")
    assert Plan.parse(path) == Plan(dp=2, microbatches=8)
    assert Plan.parse(str(path)) == Plan(dp=2, microbatches=8)


def test_parse_plan_is_returned_as_is() -> None:
    plan = Plan(dp=2)
    assert Plan.parse(plan) is plan


def test_parse_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="Plan.parse takes"):
        Plan.parse(2)  # type: ignore[arg-type]


def test_constructor_normalises_and_plan_is_frozen() -> None:
    plan = Plan(dp=2, bucket_mb=1)
    assert type(plan.bucket_mb) is float and str(plan) == "dp=2 bucket_mb=1.0"
    with pytest.raises(AttributeError):
        plan.dp = 4  # type: ignore[misc]


# -- writing and round trips -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plan", "text"),
    [
        (Plan(), "dp=1"),
        (Plan(dp=2, microbatches=4), "dp=2 mb=4"),
        (Plan(microbatches=4), "mb=4"),
        (Plan(dp=8, microbatches=2, bucket_mb=0.5), "dp=8 mb=2 bucket_mb=0.5"),
        (Plan(bucket_mb=1 / 3), f"bucket_mb={1 / 3!r}"),
    ],
)
def test_str_is_canonical_and_round_trips(plan: Plan, text: str) -> None:
    assert str(plan) == text
    assert Plan.parse(str(plan)) == plan


@pytest.mark.parametrize(
    "plan", [Plan(), Plan(dp=3, microbatches=5), Plan(dp=2, bucket_mb=1 / 3), Plan(bucket_mb=0.1 + 0.2)]
)
def test_json_round_trip_is_exact(plan: Plan) -> None:
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_dict() == plan.to_dict()


def test_to_dict_has_every_field_under_its_canonical_name() -> None:
    defaults = {"bucket_mb": None, "zero": 0, "precision": "fp32", "tp": 1, "cp": 1, "ep": 1, "dispatch": "alltoall",
                "tp_rules": "auto",
                "sequence_parallel": False, "pp": 1, "schedule": "1f1b", "virtual_stages": 1,
                "split": [], "prefetch": None, "reshard_after_forward": True, "reduce_dtype": "fp32",
                "checkpoint": "none", "rng": "fast", "zero_reduce": "auto", "compile": "eager", "loss": "full"}
    assert Plan(microbatches=4).to_dict() == {"dp": 1, "microbatches": 4} | defaults
    assert json.loads(Plan(dp=2).to_json()) == {"dp": 2, "microbatches": 1} | defaults
    assert Plan.parse(Plan(dp=2, bucket_mb=8.0).to_dict()) == Plan(dp=2, bucket_mb=8.0)


# -- degrees and checks ----------------------------------------------------------------------------


def test_world_size_is_the_product_of_the_degrees() -> None:
    assert Plan().world_size == 1
    assert Plan(dp=8, microbatches=4).world_size == 8
    plan = Plan(dp=6)
    assert plan.degrees == {"dp": 6, "pp": 1, "cp": 1, "tp": 1}
    assert plan.world_size == math.prod(plan.degrees.values())


def test_check_world_size_accepts_a_match() -> None:
    Plan(dp=4).check_world_size(4)
    Plan().check_world_size(1)


def test_check_world_size_mismatch_gives_numbers_and_fix() -> None:
    message = (
        "plan degrees multiply to 4 (dp=4) but WORLD_SIZE is 2. Fix: launch with "
        "`torchrun --nproc-per-node 4 ...` or change the plan so the degrees multiply to 2 "
        "(for example dp=2)."
    )
    with pytest.raises(PlanError) as caught:
        Plan(dp=4).check_world_size(2)
    assert str(caught.value) == message
    assert caught.value.field == "world_size" and caught.value.value == 2


def test_check_world_size_example_keeps_the_other_fields() -> None:
    with pytest.raises(PlanError, match=r"\(for example dp=8 mb=4\)"):
        Plan(dp=2, microbatches=4).check_world_size(8)


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0, "2"])
def test_check_world_size_rejects_a_non_positive_int(world_size: object) -> None:
    with pytest.raises(PlanError, match=r"WORLD_SIZE must be a positive integer.*Fix: launch"):
        Plan().check_world_size(world_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dp", "mb", "batch"), [(1, 1, 1), (2, 4, 8), (2, 4, 16), (3, 1, 9)])
def test_check_batch_accepts_multiples_of_dp_times_mb(dp: int, mb: int, batch: int) -> None:
    Plan(dp=dp, microbatches=mb).check_batch(batch)


def test_check_batch_names_numbers_and_nearest_batches() -> None:
    with pytest.raises(PlanError) as caught:
        Plan(dp=2, microbatches=4).check_batch(10)
    message = str(caught.value)
    assert "global batch 10 is not divisible by dp * microbatches = 2 * 4 = 8" in message
    assert "Fix: use a global batch of 8 or 16" in message
    assert "use mb=1" in message  # 10 / 2 = 5 samples per replica: only mb=1 divides them
    assert caught.value.field == "batch" and caught.value.value == 10


def test_check_batch_suggests_a_valid_mb_or_dp() -> None:
    with pytest.raises(PlanError) as caught:
        Plan(dp=2, microbatches=4).check_batch(12)
    message = str(caught.value)
    assert "8 or 16" in message and "use mb=3" in message and "use dp=1" in message
    Plan(dp=2, microbatches=3).check_batch(12)  # the suggested mb does fit
    Plan(dp=1, microbatches=4).check_batch(12)  # and so does the suggested dp


def test_check_batch_below_the_unit_suggests_only_the_batch_above() -> None:
    with pytest.raises(PlanError, match=r"Fix: use a global batch of 8\.$"):
        Plan(dp=2, microbatches=4).check_batch(3)


@pytest.mark.parametrize("batch", [0, -8, True, 8.0])
def test_check_batch_rejects_a_non_positive_int(batch: object) -> None:
    with pytest.raises(PlanError, match=r"global batch must be a positive integer.*Fix:"):
        Plan().check_batch(batch)  # type: ignore[arg-type]


# -- ZeRO stage and precision ----------------------------------------------------------------------


def test_zero_and_precision_parse_and_round_trip() -> None:
    plan = Plan.parse("dp=4 zero=3 precision=bf16-mixed")
    assert (plan.zero, plan.precision) == (3, "bf16-mixed")
    assert str(plan) == "dp=4 zero=3 precision=bf16-mixed"
    assert Plan.parse(str(plan)) == plan == Plan.from_json(plan.to_json())
    assert Plan.parse("zero=0") == Plan()


@pytest.mark.parametrize("entry", ["zero=4", "zero=-1", "zero=one", "zero=1.0"])
def test_zero_must_be_a_stage(entry: str) -> None:
    with pytest.raises(PlanError, match=r"zero must be one of 0, 1, 2, 3.*Fix: write e.g. zero=1"):
        Plan.parse(entry)


def test_precision_must_be_known() -> None:
    with pytest.raises(PlanError, match=r"precision must be one of 'fp32', 'bf16-mixed'.*'fp16'"):
        Plan.parse("precision=fp16")


# -- tensor parallelism ----------------------------------------------------------------------------


def test_tp_multiplies_into_the_world_and_round_trips() -> None:
    plan = Plan.parse("dp=2 tp=4 sp=true")
    assert plan.world_size == 8 and plan.degrees == {"dp": 2, "pp": 1, "cp": 1, "tp": 4}
    assert str(plan) == "dp=2 tp=4 sp=true" and Plan.parse(str(plan)) == plan


def test_tp_rules_mapping_round_trips_through_text_and_json() -> None:
    rules = {"h.*.attn.[qkv]": "colwise", "h.*.attn.o": "rowwise"}
    plan = Plan(tp=2, tp_rules=rules)
    assert Plan.parse(str(plan)) == plan == Plan.from_json(plan.to_json())
    assert Plan.parse({"tp": 2, "tp_rules": rules}) == plan


def test_sequence_parallel_needs_tp() -> None:
    with pytest.raises(PlanError, match="sequence_parallel .sp. needs tensor parallelism"):
        Plan.parse("sp=true")


def test_world_size_mismatch_example_keeps_tp() -> None:
    with pytest.raises(PlanError, match=r"\(dp=1 \* tp=2\) but WORLD_SIZE is 4.*for example dp=2 tp=2"):
        Plan(tp=2).check_world_size(4)


def test_world_size_mismatch_suggests_plans_valid_for_that_world() -> None:
    # The review's case: pp=2 tp=2 on 2 ranks once suggested dp=2 pp=2 mb=2, a 4-rank plan.
    with pytest.raises(PlanError, match=r"\(for example tp=2 mb=2, or pp=2 mb=2\)\.$"):
        Plan(pp=2, tp=2, microbatches=2).check_world_size(2)
    plans = [
        Plan(dp=4), Plan(tp=2, sequence_parallel=True), Plan(pp=2, microbatches=2, split=("h.1",)),
        Plan(dp=2, pp=2, tp=2, microbatches=2), Plan(pp=4, microbatches=4, schedule="zb-h1"),
        Plan(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2), Plan(tp=3),
        Plan(pp=3, microbatches=3, schedule="gpipe"),
    ]
    for plan in plans:
        for world in range(1, 13):
            if world == plan.world_size:
                continue
            with pytest.raises(PlanError) as caught:
                plan.check_world_size(world)
            examples = str(caught.value).rpartition("(for example ")[2].removesuffix(").")
            assert examples, str(caught.value)
            for text in examples.split(", or "):
                assert Plan.parse(text).world_size == world, (plan, world, text)


# -- pipeline parallelism --------------------------------------------------------------------------


def test_pipeline_fields_round_trip() -> None:
    for text in ("dp=2 pp=2 mb=4", "pp=2 schedule=interleaved virtual_stages=2 mb=4",
                 "pp=2 split=h.1 mb=2", "pp=4 schedule=gpipe mb=2", "pp=2 schedule=zb-h1 mb=4"):
        plan = Plan.parse(text)
        assert str(plan) == text and Plan.parse(str(plan)) == plan == Plan.from_json(plan.to_json())
    assert Plan.parse("dp=2 pp=2 tp=2 mb=2").world_size == 8


@pytest.mark.parametrize("text, match", [
    ("pp=2 mb=1", "needs at least 2 microbatches"),
    ("pp=2 mb=3 schedule=interleaved virtual_stages=2", "groups of pp=2; mb=3 is not a multiple. Fix: mb=4"),
    ("pp=2 mb=2 virtual_stages=2", "interleaved schedule needs virtual_stages >= 2, and only it"),
    ("pp=2 mb=2 split=h.1;h.2", "split names 2 stage starts, but pp x virtual_stages = 2 stages need 1"),
    ("schedule=zb", "schedule must be one of '1f1b', 'gpipe', 'interleaved', 'zb-h1'"),
    ("pp=4 mb=2 schedule=zb-h1", "schedule=zb-h1 with pp=4 needs at least 4 microbatches.*Fix: mb=4"),
    ("pp=2 mb=4 schedule=zb-h1 virtual_stages=2", "only it uses them. Fix: .* or virtual_stages=1"),
])
def test_pipeline_plan_errors(text: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Plan.parse(text)


def test_zero_bubble_schedule_is_accepted() -> None:
    plan = Plan.parse("pp=2 mb=4 schedule=zb-h1")
    assert (plan.pp, plan.microbatches, plan.schedule, plan.virtual_stages) == (2, 4, "zb-h1", 1)
    assert Plan.parse({"pp": 2, "mb": 2, "schedule": "zb-h1"}).microbatches == 2  # mb == pp is enough
