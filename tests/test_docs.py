"""Every code block of README.md and docs/*.md is run by a test here, or held by the test named.

A guide whose code does not run teaches the reader to distrust the rest of it, so the code
blocks are run as a reader would run them: from a clone's root (a temporary folder that holds
`examples/`), with `examples/` on the import path (`PYTHONPATH=examples`). A block is told
apart only by its fence and, for a multi-rank script, its first line:

    ```python    Run. A file's python blocks run in order in ONE fresh interpreter, like a
                 notebook: a later block sees the names an earlier one made (`test_guide`;
                 the files' notebooks run side by side, one per core).
    ```python    whose first line is `# torchrun --nproc-per-node N`: a whole script, written
                 to a file and run under `python -m torch.distributed.run --standalone
                 --nproc-per-node N` (gloo on CPUs); it sees no notebook names. A file's
                 torchrun blocks run in order in one folder of their own, so a later one may
                 load what an earlier one saved (`test_torchrun_blocks`, marked `multirank`).
    ```pycon     An interactive session (`>>> ` and `... ` lines, then the output): run as a
                 doctest in the notebook, in order with the python blocks, and the output
                 printed must be the output shown (whitespace runs and `...` are free).
    ```bash      Shell commands, one a line (`\\` continues a line; `#` lines are comments):
                 `fxpar ...` runs in the notebook at its place, through `fxpar.tools.cli.main`
                 (what the `fxpar` console script calls), and must exit 0; `torchrun ...` of a
                 script in the repository is checked, not run (a training run takes minutes,
                 a multi-node one needs the nodes): torchrun's own parser and the script's
                 `parse_args` accept every flag, and the plan fits the launch (its degrees
                 multiply to nnodes x nproc-per-node, the script's global batch splits into
                 dp x microbatches); the trainers themselves run in
                 tests/runtime/test_train_example.py (`test_launch_lines`).
    ```text      Not code: output, messages, diagrams. Never run.

Any other fence (or one without a language) fails `test_every_block_is_run_or_held`: a block
is run, checked or held, never skipped because nobody said what it is. The blocks held by
another test are listed in `HELD_ELSEWHERE` with that test, by file and first line:
installing (`bash scripts/setup.sh`, which needs root and the network) and the whole suite's
command are tests/test_setup.py's, which holds them to `.ci/run`; the README's `fxpar` lines
are run as written by tests/test_cli.py. A bash command that is none of the above fails.

A failing block's error names the file, the block's line and its first line. The files read are
README.md and docs/*.md, whoever writes them; links and paths are checked in every Markdown
file of README.md and docs/ (its subfolders included): a relative link or image must point to
a file in the repository (never outside it), and a path written in backticks from the
repository's top folders (`fxpar/...`, `tests/...::test_name`) must exist.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])  # the files whose code runs
MARKDOWN = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])  # links and paths checked
LANGUAGES = ("python", "pycon", "bash", "text")
TORCHRUN = re.compile(r"# torchrun (?:--standalone )?--nproc-per-node[ =](\d+)\s*$")
TIMEOUT = 300  # seconds for one file's notebook, or for one torchrun block

# (file, the block's first line starts with) -> (the test that holds the block, why not here)
HELD_ELSEWHERE = {
    ("README.md", "bash scripts/setup.sh && torchrun"): (
        "tests/test_setup.py::test_readme_commands_start_with_the_setup_script",
        "installs system packages as root; the training after it is test_train_example's"),
    ("README.md", "bash scripts/setup.sh && python3 -m pytest"): (
        "tests/test_setup.py::test_readme_test_command_is_the_one_ci_runs",
        "installs, then runs this whole suite (this test included)"),
    ("README.md", "fxpar explain"): (
        "tests/test_cli.py::test_every_fxpar_command_in_the_readme_runs_as_written",
        "every `fxpar` line of the README's bash blocks runs there as written"),
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    source: str  # dedented to the fence's indentation

    @property
    def name(self) -> str:
        return self.path.relative_to(REPO).as_posix()

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.source.splitlines() if line.strip()), "")

    @property
    def where(self) -> str:
        lines = [line.strip() for line in self.source.splitlines() if line.strip()]
        first = lines[1] if self.ranks and len(lines) > 1 else self.first_line  # past the torchrun line
        return f"{self.name}:{self.line} (block starting `{first}`)"

    @property
    def ranks(self) -> int | None:
        """N for a python block whose first line is `# torchrun --nproc-per-node N`."""
        found = TORCHRUN.match(self.first_line) if self.language == "python" else None
        return int(found.group(1)) if found else None

    @property
    def held_by(self) -> str | None:
        for (name, start), (test, _) in HELD_ELSEWHERE.items():
            if name == self.name and self.first_line.startswith(start):
                return test
        return None


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        language = (opening["info"].split() or [""])[0]
        found.append(Block(path, i + 1, language, "\n".join(body) + "\n"))
        i = j + 1
    return found


def commands_of(block: Block) -> list[str]:
    """A bash block's commands: `\\`-continued lines joined, comments and blank lines left out."""
    joined = re.sub(r"\s*\\\n\s*", " ", block.source)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in blocks_of(path)]


def notebook_steps(path: Path) -> list[dict]:
    """What the file's notebook runs, in order: python and pycon blocks, `fxpar` commands."""
    steps = []
    for block in blocks_of(path):
        if block.held_by or block.ranks:
            continue
        if block.language in ("python", "pycon"):
            steps.append({"kind": block.language, "source": block.source, "where": block.where,
                          "file": block.name, "line": block.line})
        elif block.language == "bash":
            steps += [{"kind": "fxpar", "source": command, "where": block.where}
                      for command in commands_of(block) if command.startswith("fxpar ")]
    return steps


def launch_lines() -> list[tuple[Block, str]]:
    return [(block, command) for block in all_blocks() if block.language == "bash" and not block.held_by
            for command in commands_of(block) if command.startswith("torchrun ")]


def files_with(steps) -> list[str]:
    return [path.relative_to(REPO).as_posix() for path in DOCS if steps(path)]


def _torchrun_blocks(path: Path) -> list[Block]:
    return [block for block in blocks_of(path) if block.ranks]


# -- every block is accounted for -----------------------------------------------------------------


def test_every_block_is_run_or_held():
    blocks = all_blocks()
    assert any(block.ranks for block in blocks) and any(block.language == "pycon" for block in blocks)
    problems = []
    for block in blocks:
        if block.language not in LANGUAGES:
            problems.append(f"{block.where}: fence language {block.language or '(none)'!r}; use one of "
                            f"{', '.join(LANGUAGES)} (see tests/test_docs.py's docstring)")
        elif block.language == "bash" and not block.held_by:
            for command in commands_of(block):
                if not command.startswith(("fxpar ", "torchrun ")):
                    problems.append(f"{block.where}: command {command!r} is neither run (`fxpar ...`), "
                                    "checked (`torchrun ...`) nor held (HELD_ELSEWHERE)")
        elif block.language == "pycon" and not block.first_line.startswith(">>> "):
            problems.append(f"{block.where}: a pycon block starts with its first `>>> ` line")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("held", "holder"), [(f"{name}: {start}", test) for (name, start), (test, _)
                                              in HELD_ELSEWHERE.items()])
def test_held_blocks_exist_and_so_do_the_tests_that_hold_them(held, holder):
    name, start = held.split(": ", 1)
    matching = [block for block in blocks_of(REPO / name) if block.first_line.startswith(start)]
    assert len(matching) == 1, f"HELD_ELSEWHERE names {held!r}, which matches {len(matching)} blocks"
    path, test = holder.split("::")
    defined = {node.name for node in ast.parse((REPO / path).read_text()).body if isinstance(node, ast.FunctionDef)}
    assert test in defined, f"{held!r} is held by {holder}, which does not exist"


# -- running them -----------------------------------------------------------------------------------

# Runs in the notebook's interpreter: argv[1] is a JSON list of steps; stops at the first failure.
NOTEBOOK = r'''
import doctest, json, linecache, shlex, sys, traceback

steps = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for step in steps:
    where = step["where"]
    print(f"--- {where}", flush=True)
    try:
        if step["kind"] == "python":
            filename = f"{step['file']}:{step['line']}"
            lines = step["source"].splitlines(keepends=True)
            linecache.cache[filename] = (len(step["source"]), None, lines, filename)
            exec(compile(step["source"], filename, "exec"), namespace)
        elif step["kind"] == "pycon":
            test = doctest.DocTestParser().get_doctest(step["source"], namespace, where, step["file"], step["line"])
            test.globs = namespace  # get_doctest copies it: share the notebook's names both ways
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            report = []
            runner.run(test, out=report.append, clear_globs=False)
            if runner.failures:
                raise AssertionError("the session's output differs from the block's:\n" + "".join(report))
        else:
            from fxpar.tools.cli import main
            try:
                status = main(shlex.split(step["source"])[1:])
            except SystemExit as stop:
                status = stop.code
            if status != 0:
                raise AssertionError(f"`{step['source']}` exited with status {status}")
    except BaseException:
        print(f"FAILED: {where}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
'''


def _environment() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO / "examples"), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _clone_root(folder: Path) -> Path:
    """`folder`, made to look like a clone's root: `examples/` is there."""
    (folder / "examples").symlink_to(REPO / "examples")
    return folder


def _failed(what: str, done: subprocess.CompletedProcess) -> str:
    return f"{what} failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def _run_notebook(name: str, folder: Path) -> tuple[subprocess.CompletedProcess, str]:
    steps = notebook_steps(REPO / name)
    (folder / "steps.json").write_text(json.dumps(steps))
    done = subprocess.run([sys.executable, "-c", NOTEBOOK, str(folder / "steps.json")], cwd=_clone_root(folder),
                          env=_environment(), capture_output=True, text=True, timeout=TIMEOUT)
    failed = re.search(r"^FAILED: (.*)$", done.stderr, flags=re.M)
    return done, failed.group(1) if failed else f"{name}'s notebook"


@pytest.fixture(scope="module")
def notebooks(request, tmp_path_factory):
    """The selected guides' notebooks, started together, one per core at a time (each is one
    single-threaded interpreter): `name -> Future` of `_run_notebook`'s result."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_guide" and item.module is request.module]
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(selected), os.cpu_count() or 1)))
    futures = {name: pool.submit(_run_notebook, name, tmp_path_factory.mktemp("notebook")) for name in selected}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("name", files_with(notebook_steps))
def test_guide(name, notebooks, tmp_path):
    """The file's python and pycon blocks and `fxpar` commands, in order, in one interpreter."""
    done, where = notebooks[name].result() if name in notebooks else _run_notebook(name, tmp_path)
    assert done.returncode == 0, _failed(where, done)


@pytest.mark.multirank
@pytest.mark.parametrize("name", files_with(_torchrun_blocks))
def test_torchrun_blocks(name, tmp_path):
    """The file's `# torchrun --nproc-per-node N` blocks, in order, each under torchrun."""
    folder = _clone_root(tmp_path)
    for block in _torchrun_blocks(REPO / name):
        script = folder / f"block_{block.line}.py"
        script.write_text(block.source)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={block.ranks}", script.name]
        done = subprocess.run(command, cwd=folder, env=_environment(), capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert done.returncode == 0, _failed(block.where, done)


def _script_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"docs_launch_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("where", "command"), [(f"{b.name}:{b.line}", c) for b, c in launch_lines()])
def test_launch_lines(where, command, monkeypatch):
    """A `torchrun ... SCRIPT ARGS` line: torchrun and the script take its flags, and the plan
    fits the launch (degrees x nnodes x nproc-per-node, batch / (dp x microbatches))."""
    import torch.distributed.run

    import fxpar

    launch = torch.distributed.run.get_args_parser().parse_args(shlex.split(command)[1:])
    script = REPO / launch.training_script
    assert script.is_file(), f"{where}: `{command}` runs {launch.training_script}, which is not in the repository"
    world = int(str(launch.nnodes).split(":")[-1]) * int(launch.nproc_per_node)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        args = _script_module(script).parse_args(launch.training_script_args)
    except SystemExit as stop:
        pytest.fail(f"{where}: {launch.training_script} refuses the flags of `{command}` (exit {stop.code})")
    try:
        plan = fxpar.Plan.parse(args.plan)
        plan.check_world_size(world)
        plan.check_batch(args.batch)
    except fxpar.PlanError as error:
        pytest.fail(f"{where}: `{command}`: {error}")


# -- links and paths --------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"`((?:fxpar|tests|examples|benchmarks|docs|scripts)/[\w./-]*\w(?:::\w+)?/?)`")


def _prose(path: Path) -> str:
    """The file without its fenced blocks (their lines kept, emptied, so line numbers hold)."""
    lines = path.read_text().splitlines()
    for block in blocks_of(path):
        for i in range(block.line - 1, block.line + len(block.source.splitlines()) + 1):
            if i < len(lines):
                lines[i] = ""
    return "\n".join(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", _prose(path), flags=re.M)}


@pytest.mark.parametrize("name", [path.relative_to(REPO).as_posix() for path in MARKDOWN])
def test_relative_links_point_into_the_repository(name):
    path = REPO / name
    problems = []
    for number, line in enumerate(_prose(path).splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.is_relative_to(REPO):
                problems.append(f"{name}:{number}: {target} points outside the repository")
            elif not resolved.exists():
                problems.append(f"{name}:{number}: {target} names no file")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                problems.append(f"{name}:{number}: {target}: {resolved.name} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", [path.relative_to(REPO).as_posix() for path in MARKDOWN])
def test_paths_in_backticks_exist(name):
    """`fxpar/plan/zero_reduction.py`, `tests/test_cli.py::test_name`: the file (and test) exist."""
    path = REPO / name
    problems = []
    for number, line in enumerate(_prose(path).splitlines(), 1):
        for written in PATH.findall(line):
            file, _, test = written.partition("::")
            if not (REPO / file).exists():
                problems.append(f"{name}:{number}: `{written}`: no such file or folder")
            elif test:
                tree = ast.parse((REPO / file).read_text())
                if test not in {node.name for node in tree.body if hasattr(node, "name")}:
                    problems.append(f"{name}:{number}: `{written}`: {file} defines no {test}")
    assert not problems, "\n".join(problems)

