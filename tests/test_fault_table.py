"""The fault-injection table names real tests: each row's test exists where it says.

The table (docs/guarantees.md, "The fault-injection suite") is the index of what fxpar checks
of a careless input and which test holds it to its outcome; a test renamed or removed without
the table following would leave a promise with nothing behind it.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
GUIDE = ROOT / "docs" / "guarantees.md"
SECTION = "## The fault-injection suite"


def table_tests() -> list[tuple[str, str]]:
    text = GUIDE.read_text()
    assert SECTION in text, f"{GUIDE.relative_to(ROOT)} has no section {SECTION!r}, where the table is read"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|.*`(tests/[\w/]+\.py)::(\w+)` \|$", section, flags=re.MULTILINE)


def test_every_row_names_a_test_that_exists():
    rows = table_tests()
    assert len(rows) >= 20, rows  # the table was found and read
    for path, name in rows:
        tree = ast.parse((ROOT / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert name in defined, f"docs/guarantees.md's fault table names {path}::{name}, which does not exist"
