"""Plan files and plan text as untrusted input: bounded to read, nothing of a file echoed back.

Each bad input gets a PlanError that names the file, the key or the position and a fix, in
bounded time and memory; none shows a value a plan file holds, and none shows more than 80
characters of any value.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fxpar.errors import SHOWN_CHARACTERS, PlanError
from fxpar.plan.file import MAX_PLAN_FILE_BYTES
from fxpar.plan.plan import Plan

SECRET = "sk-live-SECRET123"

# The "billion laughs": six levels of nine aliases, 9^6 = 531,441 strings from 390 bytes.
ALIAS_BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]" for a, b in zip("abcd", "bcde")),
        f"split: [{','.join(['*e'] * 9)}]",
    ]
)


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def refusal(spec: object) -> PlanError:
    start = time.perf_counter()
    with pytest.raises(PlanError) as caught:
        Plan.parse(spec)  # type: ignore[arg-type]
    assert time.perf_counter() - start < 5
    assert len(str(caught.value)) < 600
    return caught.value


def test_from_file_reads_json_and_yaml(tmp_path: Path) -> None:
    assert Plan.from_file(write(tmp_path, "p.yaml", "dp: 2\nmb: 4\n")) == Plan(dp=2, microbatches=4)
    assert Plan.from_file(str(write(tmp_path, "p.json", '{"dp": 2}'))) == Plan(dp=2)
    bom = write(tmp_path, "bom.json", b'\xef\xbb\xbf{"tp": 2}')  # Windows editors write one
    assert Plan.from_file(bom) == Plan(tp=2)


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    assert len(ALIAS_BOMB) < 400
    error = refusal(write(tmp_path, "bomb.yaml", ALIAS_BOMB))
    assert "YAML anchors and aliases (&name, *name) are not read" in str(error)
    assert "line 1, column 4" in str(error) and "Fix: write each value out" in str(error)
    assert error.field == "plan"


@pytest.mark.parametrize(
    ("name", "content", "key", "where"),
    [
        ("dup.yaml", "dp: 2\nmb: 2\ndp: 4\n", "dp", "again at line 3"),
        ("dup.json", '{"dp": 2, "dp": 4}', "dp", ""),
        ("rules.json", '{"tp": 2, "tp_rules": {"h.*": "colwise", "h.*": "rowwise"}}', "h.*", ""),
    ],
)
def test_a_key_given_twice_in_a_file_is_refused_naming_the_key(
    tmp_path: Path, name: str, content: str, key: str, where: str
) -> None:
    message = str(refusal(write(tmp_path, name, content)))
    assert f"key {key!r} is given twice" in message and where in message and "Fix: keep one" in message


def test_one_field_under_two_keys_in_a_file_names_the_keys_not_the_values(tmp_path: Path) -> None:
    message = str(refusal(write(tmp_path, "p.yaml", "mb: 1234567\nmicrobatches: 7654321\n")))
    assert "microbatches is given twice: as 'mb' and as 'microbatches'" in message
    assert "1234567" not in message and "7654321" not in message


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (f"dp: 2\napi_key: {SECRET}\n", "unknown plan key 'api_key'. Supported keys"),
        (f"dp: {SECRET}\n", "plan field dp must be a positive integer"),
        (f"tp: 2\ntp_rules: {SECRET}\n", "plan field tp_rules must be"),
        (f"split: [{SECRET}]\npp: 3\nmb: 4\n", "split names 1 stage starts"),
        (f"- {SECRET}\n", "holds a list, not a mapping"),
        (f"dp: [{SECRET}\n", "is not valid YAML"),
    ],
)
def test_a_files_values_are_never_echoed(tmp_path: Path, content: str, expected: str) -> None:
    error = refusal(write(tmp_path, "plan.yaml", content))
    assert expected in str(error) and "plan file '" in str(error)
    assert SECRET not in str(error)


def test_a_value_from_a_file_is_described_by_type_and_size(tmp_path: Path) -> None:
    message = str(refusal(write(tmp_path, "p.yaml", "dp: two\n")))
    assert "got a str of 3 characters (a plan file's values are not shown)" in message


def test_a_binary_file_is_a_plan_error_naming_the_byte(tmp_path: Path) -> None:
    error = refusal(write(tmp_path, "plan.yaml", b"\x89PNG\r\n\x1a\n\x00"))
    assert "is not UTF-8 text: byte 0x89 at offset 0" in str(error)
    error = refusal(write(tmp_path, "nul.yaml", b"dp: 2\n\x00\n"))
    assert "special characters are not allowed (character #x0000) at position 6" in str(error)


def test_a_file_over_the_cap_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    assert MAX_PLAN_FILE_BYTES == 1 << 20
    path = write(tmp_path, "plan.json", '{"dp": 2, "x": "' + "a" * MAX_PLAN_FILE_BYTES + '"}')
    assert "is larger than 1,048,576 bytes (1 MiB)" in str(refusal(path))
    write(tmp_path, "ok.json", '{"dp": 2, "mb": 2}' + " " * (MAX_PLAN_FILE_BYTES - 100))
    assert Plan.from_file(tmp_path / "ok.json") == Plan(dp=2, microbatches=2)


@pytest.mark.parametrize("name", ["deep.json", "deep.yaml"])
def test_nesting_too_deep_is_a_plan_error(tmp_path: Path, name: str) -> None:
    error = refusal(write(tmp_path, name, "[" * 50_000 + "]" * 50_000))
    assert "nests its values too deeply to read" in str(error)


def test_a_string_is_read_as_a_file_only_when_it_names_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "plan.yaml", "dp: 2\n")
    assert Plan.parse("plan.yaml") == Plan(dp=2)
    assert "does not exist" in str(refusal("other.yaml"))  # looked up, and nothing read
    write(tmp_path, "dp=2", "tp: 2\n")  # plan text that happens to name a file stays text
    assert Plan.parse("dp=2") == Plan(dp=2)


def test_a_folder_or_device_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "folder.yaml").mkdir()
    assert "does not exist or is not a file" in str(refusal(tmp_path / "folder.yaml"))


@pytest.mark.parametrize(
    "spec",
    [
        "dp=" + "x" * 100_000,
        "x" * 100_000,
        "tp_rules=" + "{" * 100_000,
        "dp=" + "9" * 100_000,
        "k" * 100_000 + "=2",
        {"dp": list(range(100_000))},
        {"split": "h." * 100_000},
    ],
)
def test_every_value_echoed_from_text_is_cut_to_80_characters(spec: object) -> None:
    error = refusal(spec)
    assert len(str(error)) < 550  # the list of supported keys and one clipped value
    for word in str(error).split():
        assert len(word) <= SHOWN_CHARACTERS + 10, word


def test_a_value_that_shares_itself_is_shown_in_bounded_time() -> None:
    bomb: list = ["lol"]
    for _ in range(60):  # 2^60 leaves: its full repr would never finish
        bomb = [bomb, bomb]
    error = refusal({"split": bomb})
    assert "plan field split must be a list of module paths" in str(error)
