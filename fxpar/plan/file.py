"""Plan files: the JSON or YAML mapping a plan file holds, read as untrusted input.

A plan file may come from anywhere (a shared config folder, a job submitted by someone else),
so reading one is bounded and says nothing of the file beyond what is needed to fix it:

* at most `MAX_PLAN_FILE_BYTES` (1 MiB) are read; a plan is a few lines, and a larger file is
  refused before it is parsed;
* the file must be UTF-8 text (a leading byte-order mark is allowed): a binary file is refused
  naming the first byte that is not;
* a key given twice is refused naming the key (JSON and YAML parsers keep the last one
  silently, so `dp: 2` then `dp: 4` would train on 4 ranks without a word);
* YAML anchors and aliases (`&a`, `*a`) are refused when the parser meets them, before
  anything is expanded: ten nested aliases of ten items each are 10^10 values, the "billion
  laughs" a 400-byte file can hold; a plan has no use for them;
* nesting too deep to parse is refused, not a RecursionError;
* messages name the file, the line and the column, and the key; never a value of the file, so
  a file that holds a secret (`api_key: sk-...`) is not echoed into logs. YAML's own messages
  quote the offending line, so they are rebuilt from its problem and position.

    read_plan_file(Path("plan.yaml"))    # -> ({"dp": 2, "mb": 4}, "YAML")

`Plan.from_file` builds the plan from the mapping; `fxpar.plan.text` reads the text form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml

from fxpar.errors import PlanError, shown

MAX_PLAN_FILE_BYTES = 1 << 20  # 1 MiB
FILE_SUFFIXES = (".json", ".yaml", ".yml")

Language = Literal["JSON", "YAML"]


def describe_file(path: Path) -> str:
    """How messages name the file: `plan file 'configs/plan.yaml'`."""
    return f"plan file {shown(str(path))}"


def read_plan_file(path: Path) -> tuple[Mapping[object, object], Language]:
    """The mapping of plan keys `path` holds, and its language; every refusal is a PlanError
    with `field="plan"` and `value` the path (see the module doc)."""
    where = describe_file(path)
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        found = f"suffix {shown(suffix)}" if suffix else "no suffix"
        _refuse(path, f"{where} has {found}; fxpar reads plan files ending in .json, .yaml or "
                ".yml. Fix: save the plan as JSON or YAML, or pass the text form such as 'dp=2'.")
    if not path.is_file():  # a folder, a device such as /dev/zero, or nothing at all
        _refuse(path, f"{where} does not exist or is not a file (looked for "
                f"{shown(str(path.resolve()))}). Fix: check the path, or pass the text form "
                "such as 'dp=2'.")
    with path.open("rb") as file:
        data = file.read(MAX_PLAN_FILE_BYTES + 1)
    if len(data) > MAX_PLAN_FILE_BYTES:
        _refuse(path, f"{where} is larger than {MAX_PLAN_FILE_BYTES:,} bytes (1 MiB), the most "
                "fxpar reads as a plan; a plan is a few lines. Fix: check that the path names "
                "the plan file.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        _refuse(path, f"{where} is not UTF-8 text: byte {error.object[error.start]:#04x} at "
                f"offset {error.start} is not valid UTF-8 (a binary file?). Fix: save the plan "
                "as UTF-8 JSON or YAML.")
    language: Language = "JSON" if suffix == ".json" else "YAML"
    return parse_mapping(text, language=language, where=where, value=str(path), echo=False), language


def parse_mapping(
    text: str, *, language: Language, where: str, value: object, echo: bool = True
) -> Mapping[object, object]:
    """The mapping a JSON or YAML `text` holds; bad syntax, a repeated key, a YAML alias or
    another kind of value raises PlanError (`where` starts the message, `value` is the error's
    value). With `echo=False` (a file's content) the message shows no value of the text."""
    try:
        data = _load(text, language)
    except _Refused as refused:
        raise PlanError(f"{where}: {refused}", field="plan", value=value) from None
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise PlanError(
            f"{where} is not valid {language}: {_syntax_problem(error)}. Fix: correct its syntax.",
            field="plan", value=value,
        ) from None
    except RecursionError:
        raise PlanError(
            f"{where} nests its values too deeply to read. Fix: write a flat mapping such as "
            '{"dp": 2, "mb": 4}.', field="plan", value=value,
        ) from None
    except ValueError as error:  # an integer of more than 4300 digits, for one
        raise PlanError(
            f"{where} holds a value Python cannot read ({type(error).__name__}). Fix: write "
            'plain numbers and strings, such as {"dp": 2, "mb": 4}.', field="plan", value=value,
        ) from None
    if isinstance(data, Mapping):
        return data
    content = f" ({shown(data)})" if echo else ""
    raise PlanError(
        f"{where} holds a {type(data).__name__}{content}, not a mapping of plan keys to "
        'values. Fix: write a mapping such as {"dp": 2, "mb": 4} (in YAML: "dp: 2").',
        field="plan",
        value=value,
    )


class _Refused(Exception):
    """A well-formed text fxpar does not read: a repeated key, a YAML anchor or alias."""


def _load(text: str, language: Language) -> object:
    if language == "JSON":
        return json.loads(text, object_pairs_hook=_json_object)
    loader = _PlanLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _json_object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    found: dict[str, object] = {}
    for key, item in pairs:
        if key in found:
            raise _Refused(f"key {shown(key)} is given twice. Fix: keep one of them.")
        found[key] = item
    return found


class _PlanLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors, aliases and repeated keys (module doc).

    The pure-Python loader, not CSafeLoader: only its `compose_node` can be overridden, and that
    is where an alias is met before it is resolved.
    """

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(
                f"YAML anchors and aliases (&name, *name) are not read in plan files (line "
                f"{event.start_mark.line + 1}, column {event.start_mark.column + 1}): expanding "
                "them can multiply a small file into gigabytes. Fix: write each value out."
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    mark = key_node.start_mark
                    raise _Refused(
                        f"key {shown(key)} is given twice (again at line {mark.line + 1}). "
                        "Fix: keep one of them."
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _syntax_problem(error: Exception) -> str:
    """What is wrong and where, without the quoted line YAML's message carries."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno}, column {error.colno}"
    if isinstance(error, yaml.reader.ReaderError):  # a control character, such as NUL
        code = error.character if isinstance(error.character, int) else ord(error.character)
        return f"{error.reason} (character #x{code:04x}) at position {error.position}"
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or type(error).__name__
    if mark is None:
        return problem
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _refuse(path: Path, message: str) -> None:
    raise PlanError(message, field="plan", value=str(path))
