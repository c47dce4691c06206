"""Plan's errors: unknown and malformed keys, duplicates, bad values of every field, files that
cannot be read; each a PlanError naming the field, the value, the rule and a fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fxpar.errors import FxparError, PlanError
from fxpar.plan.plan import Plan


# -- errors ----------------------------------------------------------------------------------------


def test_plan_error_is_a_value_error() -> None:
    assert issubclass(PlanError, ValueError) and issubclass(PlanError, FxparError)
    with pytest.raises(ValueError):
        Plan.parse("dp=0")


def test_unknown_key_lists_keys_and_suggests_the_closest() -> None:
    with pytest.raises(PlanError) as caught:
        Plan.parse("dpp=2")
    message = str(caught.value)
    assert "unknown plan key 'dpp'" in message and "dpp=2" in message
    assert "Did you mean 'dp' or 'pp'?" in message
    assert "Supported keys: dp, tp, pp, cp, ep, dispatch, sp, tp_rules, schedule, virtual_stages, split, mb (or microbatches), bucket_mb, zero, zero_reduce, precision" in message
    assert "Fix: rename or remove 'dpp'" in message
    assert caught.value.field == "dpp" and caught.value.value == "2"


def test_unknown_key_without_a_close_match_has_no_suggestion() -> None:
    with pytest.raises(PlanError, match="Supported keys") as caught:
        Plan.parse({"learning_rate": 3e-4})
    assert "Did you mean" not in str(caught.value)


def test_unknown_key_suggestion_uses_difflib_for_other_typos() -> None:
    with pytest.raises(PlanError, match="Did you mean 'microbatches'"):
        Plan.parse("microbatch=4")
    with pytest.raises(PlanError, match="Did you mean 'bucket_mb'"):
        Plan.parse("bucket_mib=4")


@pytest.mark.parametrize("text", ["auto", " AUTO "])
def test_auto_is_a_search_not_a_plan(text: str) -> None:
    with pytest.raises(PlanError, match=r"not one plan but a search.*fxpar.plan_auto") as caught:
        Plan.parse(text)
    assert caught.value.field == "plan" and caught.value.value == text


@pytest.mark.parametrize(
    ("text", "field", "value", "problem", "fix"),
    [
        ("dp", "dp", "dp", "has no '='", "write it as dp=<value>"),
        ("dp=2 mb", "mb", "mb", "has no '='", "write it as mb=<value>"),
        ("dp = 2", "dp", "dp", "has no '='", "no spaces around '='"),
        ("dp=", "dp", "dp=", "has no value after '='", "give one, e.g. dp=2"),
        ("=2", "plan", "=2", "has no key before '='", "name the field, e.g. dp=2"),
        ("dp=2=3", "dp", "dp=2=3", "has more than one '='", "separate entries with spaces"),
    ],
)
def test_malformed_entries(text: str, field: str, value: str, problem: str, fix: str) -> None:
    with pytest.raises(PlanError) as caught:
        Plan.parse(text)
    message = str(caught.value)
    assert f"plan entry {value!r} {problem}" in message
    assert "key=value" in message and "Fix: " in message and fix in message
    assert caught.value.field == field and caught.value.value == value


@pytest.mark.parametrize(
    ("spec", "field", "written"),
    [
        ("dp=2 dp=4", "dp", "dp=2 and dp=4"),
        ("mb=2, microbatches=4", "microbatches", "mb=2 and microbatches=4"),
        ({"mb": 2, "microbatches": 2}, "microbatches", "mb=2 and microbatches=2"),
    ],
)
def test_duplicate_keys(spec: str | dict[str, int], field: str, written: str) -> None:
    with pytest.raises(PlanError, match=f"plan field {field} is given twice: {written}. Fix: keep"):
        Plan.parse(spec)


@pytest.mark.parametrize(
    ("spec", "field", "value"),
    [
        ("dp=two", "dp", "two"),
        ("dp=0", "dp", 0),
        ("dp=-1", "dp", -1),
        ("dp=1.5", "dp", "1.5"),
        ("mb=0", "microbatches", 0),
        ("microbatches=x", "microbatches", "x"),
        ({"dp": True}, "dp", True),
        ({"dp": 2.0}, "dp", 2.0),
        ({"mb": None}, "microbatches", None),
    ],
)
def test_bad_integer_values(spec: str | dict[str, object], field: str, value: object) -> None:
    with pytest.raises(PlanError) as caught:
        Plan.parse(spec)
    message = str(caught.value)
    assert f"plan field {field}" in message and "must be a positive integer" in message
    assert f"got {value!r}" in message and "Fix: write e.g." in message
    assert caught.value.field == field and caught.value.value == value


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("bucket_mb=0", "0.0"),
        ("bucket_mb=-2", "-2.0"),
        ("bucket_mb=nan", "nan"),
        ("bucket_mb=inf", "inf"),
        ("bucket_mb=big", "'big'"),
        ({"bucket_mb": True}, "True"),
        # A size that rounds to no byte used to pass here and fail deep in a pass
        # ("bucket_bytes must be positive"); one that overflows a float, with an OverflowError.
        ("bucket_mb=1e-30", "1e-30"),
        ({"bucket_mb": 0.0009}, "0.0009"),
        ("bucket_mb=1e308", "1e+308"),
        ({"bucket_mb": 2**20 + 1}, "1048577"),
        ({"bucket_mb": 10**400}, "100000000000000000...0000000000000000000"),
    ],
)
def test_bad_bucket_sizes(spec: str | dict[str, object], shown: str) -> None:
    expected = (
        f"plan field bucket_mb must be a number of MiB from 1/1024 (one KiB) to 1048576 (one TiB; "
        f"the gradient-bucket size); got {shown}. Fix: write e.g. bucket_mb=25, or leave bucket_mb out"
    )
    with pytest.raises(PlanError, match=re.escape(expected)) as caught:
        Plan.parse(spec)
    assert caught.value.field == "bucket_mb"


def test_buckets_from_one_kib_to_one_tib_are_accepted() -> None:
    assert Plan(bucket_mb=1 / 1024).bucket_mb * 2**20 == 1024
    assert Plan(bucket_mb=2**20).bucket_mb * 2**20 == 2**40


@pytest.mark.parametrize(
    "kwargs",
    [{"dp": 0}, {"microbatches": -3}, {"dp": "2"}, {"bucket_mb": float("nan")}, {"bucket_mb": 1e-30},
     {"zero": 2.0}, {"zero": True}, {"prefetch": True}, {"prefetch": 1.0}, {"virtual_stages": 0}],
)
def test_constructor_validates_like_parse(kwargs: dict[str, object]) -> None:
    (field,) = kwargs
    with pytest.raises(PlanError, match=f"plan field {field}") as caught:
        Plan(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(PlanError, match=r"does not exist.*Fix: check the path") as caught:
        Plan.parse(path)
    assert "missing.yaml" in str(caught.value)
    assert caught.value.field == "plan" and caught.value.value == str(path)


@pytest.mark.parametrize("spec", ["plan.toml", Path("plan.toml"), Path("plan")])
def test_unsupported_file_suffix(spec: str | Path) -> None:
    with pytest.raises(PlanError, match=r"\.json, \.yaml or \.yml\. Fix: save the plan") as caught:
        Plan.parse(spec)
    assert "plan.toml" in str(caught.value) or "no suffix" in str(caught.value)
    assert caught.value.value == str(spec)


@pytest.mark.parametrize(
    ("name", "content", "kind"),
    [
        ("plan.json", "[2, 4]", "list"),
        ("plan.yaml", "- dp\n- 2\n", "list"),
        ("plan.yml", "dp=2\n", "str"),
        ("plan.yaml", "", "NoneType"),
    ],
)
def test_file_that_is_not_a_mapping(tmp_path: Path, name: str, content: str, kind: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    expected = f"holds a {kind}, not a mapping.*Fix: write a mapping"  # the content unsaid
    with pytest.raises(PlanError, match=expected) as e:
        Plan.parse(path)
    assert e.value.field == "plan" and e.value.value == str(path)


@pytest.mark.parametrize(("name", "content"), [("plan.json", "{dp: 2"), ("plan.yaml", "dp: [2")])
def test_file_with_bad_syntax(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PlanError, match=r"is not valid (JSON|YAML): .* at line 1, column \d+\. Fix: correct its syntax") as e:
        Plan.parse(path)
    assert e.value.field == "plan" and e.value.value == str(path)


def test_error_inside_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("dp: 2\npp: 4\n")
    with pytest.raises(PlanError, match=r"plan\.yaml.*needs at least 4 microbatches") as caught:
        Plan.parse(path)
    assert caught.value.field == "microbatches" and caught.value.value == 1


def test_from_json_errors() -> None:
    with pytest.raises(PlanError, match="plan JSON is not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(PlanError, match="plan JSON holds a list"):
        Plan.from_json("[1]")
    with pytest.raises(PlanError, match="Did you mean 'dp'"):  # also 'pp': both are one letter off
        Plan.from_json('{"dpp": 2}')
