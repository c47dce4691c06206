"""The README's fault-injection table names real tests: each row's test exists where it says.

The table (README.md, "The fault-injection suite") is the index of what fxpar checks of a
careless input and which test holds it to its outcome; a test renamed or removed without the
table following would leave a promise with nothing behind it.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def table_tests() -> list[tuple[str, str]]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The fault-injection suite", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|.*`(tests/[\w/]+\.py)::(\w+)` \|$", section, flags=re.MULTILINE)


def test_every_row_names_a_test_that_exists():
    rows = table_tests()
    assert len(rows) >= 20, rows  # the table was found and read
    for path, name in rows:
        tree = ast.parse((ROOT / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert name in defined, f"README's fault table names {path}::{name}, which does not exist"
