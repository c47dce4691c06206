"""No function in fxpar/ is longer than 60 lines, from its `def` line to its last, docstring
included: a longer one is split into named steps, each with a docstring that says what it does.

Methods and nested functions count too, each on its own lines (a nested function's lines also
count towards the function around it). Decorators do not: the count starts at `def`.
"""

import ast
from pathlib import Path

import fxpar

PACKAGE = Path(fxpar.__file__).parent
MOST_LINES = 60


def too_long(path: Path, root: Path) -> list[str]:
    """'file:line function (n lines)' for each function of `path` over `MOST_LINES` lines,
    the file named relative to `root`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MOST_LINES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_60_lines():
    found = [entry for path in sorted(PACKAGE.rglob("*.py")) for entry in too_long(path, PACKAGE.parent)]
    assert not found, (
        f"functions over {MOST_LINES} lines (def line to last line); split each into named "
        "steps:\n  " + "\n  ".join(found)
    )


def test_the_count_runs_from_def_to_the_last_line(tmp_path):
    body = [f"x{i} = {i}" for i in range(MOST_LINES - 2)]
    fits = ["@staticmethod", "def fits():", "    '''A docstring.'''", *("    " + line for line in body)]
    over = ["class C:", "    def over(self):", "        '''A docstring.'''",
            *("        " + line for line in body), "        return 1"]
    (tmp_path / "fits.py").write_text("\n".join(fits) + "\n")  # def, docstring, 58 lines: 60
    (tmp_path / "over.py").write_text("\n".join(over) + "\n")  # one more: 61
    assert too_long(tmp_path / "fits.py", tmp_path) == []
    assert too_long(tmp_path / "over.py", tmp_path) == ["over.py:2 over (61 lines)"]
