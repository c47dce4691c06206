"""One setup: the README's commands, `.ci/run` and `scripts/setup.sh` say the same thing.

The README's "Two commands on a fresh machine" both start with the setup script, and its test
command is the one CI runs, so a newcomer who follows the README gets what CI gets:

    README    bash scripts/setup.sh && python3 -m pytest -q
    .ci/run   bash scripts/setup.sh ... python3 -m pytest -q || status=$?

These tests read the files as text (nothing is installed); `bash -n` checks the two scripts
parse.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = "scripts/setup.sh"
SETUP_COMMAND = f"bash {SETUP}"
SECTION = "## Two commands on a fresh machine"


def _readme_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.find(SECTION)
    assert start >= 0, f"README.md has no section {SECTION!r}, where the commands are read"
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


def _readme_commands() -> list[list[str]]:
    """Each bash block of the section as its `&&`-joined commands."""
    blocks = re.findall(r"```bash\n(.*?)```", _readme_section(), flags=re.S)
    assert len(blocks) == 2, f"expected the two commands as two ```bash blocks, found {len(blocks)}"
    return [[part.strip() for part in block.strip().split("&&")] for block in blocks]


def _ci_test_command() -> str:
    """The pytest line of .ci/run, without its `|| status=$?`."""
    lines = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()]
    found = [line for line in lines if "pytest" in line and not line.startswith(("#", "echo"))]
    assert len(found) == 1, f".ci/run should run pytest on exactly one line, found {found}"
    return found[0].split("||")[0].strip()


def test_readme_commands_start_with_the_setup_script():
    for commands in _readme_commands():
        assert commands[0] == SETUP_COMMAND, (
            f"README command {' && '.join(commands)!r} should start with {SETUP_COMMAND!r}, the one "
            "setup .ci/run runs too"
        )
    assert (REPO / SETUP).is_file(), f"the README runs {SETUP}, which is not in the repository"


def test_readme_test_command_is_the_one_ci_runs():
    readme = _readme_commands()[1][-1]
    ci = _ci_test_command()
    assert readme == ci, f"README's test command {readme!r} differs from .ci/run's {ci!r}"


def test_ci_runs_the_setup_script():
    lines = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()]
    assert SETUP_COMMAND in lines, f".ci/run should run {SETUP_COMMAND!r} on a line of its own"


def test_fast_loop_is_the_test_command_without_the_multirank_tier():
    """The README's inner loop is its test command plus a marker that pyproject declares."""
    test_command = _readme_commands()[1][-1]
    fast = re.search(r"`(python3 -m pytest[^`]*-m [^`]*)`", _readme_section())
    assert fast, ("README's setup section should give the fast inner loop as "
                  "`python3 -m pytest ... -m ...`")
    words = shlex.split(fast.group(1))
    marker = words[words.index("-m", 2) + 1]
    assert shlex.join(words[:words.index("-m", 2)]) == test_command, (
        f"the fast loop {fast.group(1)!r} should be the test command {test_command!r} plus -m"
    )
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    names = {m.split(":")[0].strip() for m in declared["markers"]}
    assert marker == "not multirank" and "multirank" in names, (
        f"the fast loop selects {marker!r}; expected 'not multirank', with `multirank` declared "
        f"in pyproject.toml's pytest markers (declared: {sorted(names)})"
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", [SETUP, ".ci/run"])
def test_script_parses(script):
    done = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert done.returncode == 0, f"bash -n {script}: {done.stderr}"
