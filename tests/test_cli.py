"""The `fxpar` command line: every command, its errors and exit status, and the README's commands.

Commands run in this process through `fxpar.tools.cli.main` (what the console script and
`python -m fxpar` call), so torch is imported once; one test runs `python -m fxpar` itself to
check the entry point, the exit status and that a usage error prints no traceback.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fxpar.cost.hardware import PROFILES
from fxpar.cost.profile_files import save_profile
from fxpar.tools.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model", "examples/gpt.py:factory", "--config", "n_layer=2", "n_embd=32", "seq=16", "batch=8"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run from an empty folder that sees the repository's examples/, as in a fresh clone."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_explain_shows_stages_buckets_collectives_and_the_estimate(in_tmp, capsys):
    status, out, _ = run(capsys, "explain", *SMALL, "--plan", "dp=2 tp=2 pp=2 mb=2", "--rank", "5")
    assert status == 0
    assert out.startswith("plan 'dp=2 pp=2 tp=2 mb=2' on Mesh(dp=2, pp=2, tp=2): 8 ranks")
    for expected in ("stage rank  modules", "rank 1 .   1F0 1B0", "gradient buckets of rank 5 (dp 1, pp 0, tp 1)",
                     "stage 0 bucket 0:", "all_reduce tp all_reduce", "fxpar estimate: plan"):
        assert expected in out


def test_explain_reads_one_rank_and_never_checks_all_of_them(in_tmp, capsys, monkeypatch):
    """What keeps `fxpar explain` on the 175B shape at 1024 ranks near 30 s (docs/cost-model.md): it
    never matches every rank's collectives, and asks for one rank's only."""
    import fxpar.compiler.program

    asked = []
    collectives = fxpar.compiler.program.Program.collectives
    monkeypatch.setattr(fxpar.compiler.program.Program, "check", lambda self: pytest.fail("explain ran check()"))
    monkeypatch.setattr(fxpar.compiler.program.Program, "collectives",
                        lambda self, rank, **kw: asked.append(rank) or collectives(self, rank, **kw))
    status, _, _ = run(capsys, "explain", *SMALL, "--plan", "dp=2 tp=2 pp=2 mb=2", "--rank", "3")
    assert status == 0
    # rank 3 for the listing, and the estimate's one rank per pipeline coordinate (0 and 2)
    assert set(asked) <= {3, 0, 2}


def test_viz_and_report_write_the_file_named_by_output(in_tmp, capsys):
    status, out, _ = run(capsys, "viz", *SMALL, "--plan", "tp=2 pp=2 mb=2", "-o", "g.svg", "--expand", "h.1")
    assert (status, out.strip()) == (0, "wrote g.svg") and "<svg" in (in_tmp / "g.svg").read_text()
    status, out, _ = run(capsys, "report", *SMALL, "--plan", "pp=2 mb=2", "--compare", "dp=2", "-o", "r.html")
    assert status == 0 and "Compared with plan" in (in_tmp / "r.html").read_text()


def test_check_passes_and_fails_with_statuses_0_and_1(in_tmp, capsys, monkeypatch):
    status, out, _ = run(capsys, "check", *SMALL, "--plan", "dp=2 pp=2 mb=2")
    assert status == 0 and "every send has its receive" in out
    import fxpar.compiler.program

    def mismatch(self):  # what check() raises for a plan whose ranks would hang
        raise fxpar.PlanError("collective #3 on process group [0, 1] does not match")

    monkeypatch.setattr(fxpar.compiler.program.Program, "check", mismatch)
    status, _, err = run(capsys, "check", *SMALL, "--plan", "dp=2")
    assert status == 1 and err.startswith("fxpar check: FAILED: collective #3 on process group [0, 1]")


def test_estimate_and_diff(in_tmp, capsys):
    status, out, _ = run(capsys, "estimate", *SMALL, "--plan", "dp=2", "--hardware", "a100", "--optimizer", "sgd")
    assert status == 0 and out.startswith("fxpar estimate: plan 'dp=2' on a100, sgd")
    status, out, _ = run(capsys, "diff", "dp=2", "tp=2", *SMALL)
    assert status == 0 and "+ rank 0 per step: all_reduce tp all_reduce" in out
    save_profile(replace(PROFILES["a100"], name="our-a100"), in_tmp / "ours.json")  # a measured machine
    status, out, _ = run(capsys, "estimate", *SMALL, "--plan", "dp=2", "--hardware", "ours.json")
    assert status == 0 and out.startswith("fxpar estimate: plan 'dp=2' on our-a100")


def test_plans_from_json_and_yaml_files(in_tmp, capsys):
    (in_tmp / "plan.yaml").write_text("dp: 2\nmicrobatches: 2\n")
    (in_tmp / "plan.json").write_text('{"tp": 2}')
    status, out, _ = run(capsys, "diff", "plan.yaml", "plan.json", *SMALL)
    assert status == 0 and out.startswith("plan diff: 'dp=2 mb=2' -> 'tp=2'")


def test_a_hugging_face_model_from_its_config(in_tmp, capsys):
    pytest.importorskip("transformers")
    config = ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
              "num_key_value_heads=2", "vocab_size=256"]
    status, out, _ = run(capsys, "check", "--hf", "llama", "--config", *config, "--seq", "16", "--plan", "dp=2 tp=2")
    assert status == 0 and out.startswith("check passed: plan 'dp=2 tp=2', 4 ranks")


@pytest.mark.parametrize(("argv", "message"), [
    (["explain", "--model", "missing.py:factory", "--plan", "dp=2"], "no file missing.py"),
    (["explain", "--model", "examples/gpt.py:nope", "--plan", "dp=2"], "has no function 'nope'. Its functions: factory"),
    (["explain", "--model", "examples/gpt.py", "--plan", "dp=2"], "expected FILE.py:FACTORY"),
    (["explain", "--model", "no_such_package.models:f", "--plan", "dp=2"], "cannot import module 'no_such_package.models'"),
    (["explain", *SMALL, "n_layers=3", "--plan", "dp=2"], "it takes n_layer, n_head"),
    (["explain", "--plan", "dp=2"], "exactly one of --model"),
    (["explain", *SMALL, "--plan", "dp=3"], "not divisible by dp \\* microbatches"),
    (["explain", *SMALL, "--plan", "dq=2"], "dq"),
    (["viz", *SMALL, "--plan", "dp=2", "--expand", "h.7"], "names no module"),
    (["explain", *SMALL, "--plan", "dp=2", "--rank", "2"], "ranks 0..1"),
    (["estimate", *SMALL, "--plan", "dp=2", "--hardware", "tpu"], "known profiles are cpu"),
    (["estimate", *SMALL, "--plan", "dp=2", "--hardware", "absent.json"], "'absent.json' does not exist"),
    (["verify", "--hf", "llama", "--plan", "dp=2"], "--hf builds it on the meta device without weights"),
])
def test_usage_errors_exit_2_with_what_was_wrong_and_the_fix(in_tmp, capsys, argv, message):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert re.search(message, err), err
    assert err.startswith(f"fxpar {argv[0]}: error: ") and "Traceback" not in err


BAD_FACTORIES = """
import torch


def raises(width=2):
    raise RuntimeError("no GPU here\\nand a second line of detail")


def model_alone():
    return torch.nn.Linear(2, 2)


def three_things():
    return torch.nn.Linear(2, 2), torch.ones(2, 2), 1


def a_number_for_inputs():
    return torch.nn.Linear(2, 2), 5


def ints_for_inputs():
    return torch.nn.Linear(2, 2), [torch.ones(2), 3]
"""


@pytest.mark.parametrize(("factory", "message"), [
    ("raises", "raises(width=4) raised RuntimeError: no GPU here (and 1 more line). Fix: correct the factory or its --config values"),
    ("model_alone", "model_alone() returned a Linear model alone, not (model, example_inputs). Fix: return"),
    ("three_things", "three_things() returned a tuple of 3 items (Linear, Tensor, int), not (model, example_inputs)"),
    ("a_number_for_inputs", "a_number_for_inputs() returned (Linear, an int (5)): its example_inputs are not one "
                            "batch of tensors. Fix: return (model, inputs) with inputs a tensor, a tuple of tensors"),
    ("ints_for_inputs", r"ints_for_inputs() returned (Linear, a list of 2 items (Tensor, int)): its example_inputs"),
])
def test_a_factory_that_raises_or_returns_something_else_exits_2_in_one_line(in_tmp, capsys, factory, message):
    (in_tmp / "bad.py").write_text(BAD_FACTORIES)
    config = ["--config", "width=4"] if factory == "raises" else []
    status, _, err = run(capsys, "explain", "--model", f"bad.py:{factory}", *config, "--plan", "dp=1")
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fxpar explain: error: --model 'bad.py:{factory}': {message}"), err


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "broken.py:factory"], "--model 'broken.py:factory': running broken.py failed: ZeroDivisionError: "
                                       "division by zero. Fix: run `python broken.py` to see the traceback"),
    (["--hf", "llama", "--config", "hidden_size=65", "num_attention_heads=4"],
     "--hf llama --config {'hidden_size': 65, 'num_attention_heads': 4}: ValueError: The hidden size (65) is not a "
     "multiple of the number of attention heads (4). Fix: correct the --config fields it names"),
    (["--hf", "llama", "--batch", "0"], "--hf 'llama': --batch 0: the example batch needs at least one row"),
    (["--hf", "lama"], "--hf 'lama': transformers does not know this model type. Fix: a model_type such as llama"),
])
def test_a_model_that_cannot_be_built_exits_2_in_one_line(in_tmp, capsys, argv, message):
    (in_tmp / "broken.py").write_text("import torch\n\nWIDTH = 1 / 0\n")
    status, _, err = run(capsys, "check", *argv, "--plan", "dp=2")
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fxpar check: error: {message}"), err


@pytest.mark.parametrize(("command", "output", "problem"), [
    ("viz", "missing/plan.svg", "-o 'missing/plan.svg' names folder 'missing', which does not exist. Fix: create it "
                                "(mkdir -p missing) or write elsewhere"),
    ("report", "notes.txt/plan.html", "-o 'notes.txt/plan.html' names folder 'notes.txt', which is a file. Fix: name a "
                                   "file in a folder, e.g. -o plan.html"),
    ("report", "out", "-o 'out' is a folder. Fix: name a file in it, e.g. -o out/plan.html"),
    ("viz", "g.jpg", "-o 'g.jpg' ends in '.jpg', and the suffix picks the format. Fix: end it in one of .svg, "
                     ".png, .pdf, e.g. -o g.svg"),
])
def test_an_output_that_cannot_be_written_exits_2_before_anything_compiles(in_tmp, capsys, monkeypatch, command,
                                                                           output, problem):
    (in_tmp / "notes.txt").write_text("")
    (in_tmp / "out").mkdir()
    monkeypatch.setattr("fxpar.tools.cli._capture", lambda args: pytest.fail("captured before checking -o"))
    status, _, err = run(capsys, command, *SMALL, "--plan", "dp=2", "-o", output)
    assert (status, err) == (2, f"fxpar {command}: error: {problem}\n")


def test_python_m_fxpar_help_examples_and_a_bad_flag(in_tmp):
    done = subprocess.run([sys.executable, "-m", "fxpar", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and all(name in done.stdout for name in COMMANDS)
    for name, (_, example) in COMMANDS.items():  # every command's --help shows its example
        assert example.startswith(f"fxpar {name} ")
    with pytest.raises(SystemExit) as exit_:
        main(["viz", "--help"])
    assert exit_.value.code == 0
    done = subprocess.run([sys.executable, "-m", "fxpar", "explain", "--plan", "dp=2", "--bogus"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr
    assert "Traceback" not in done.stderr
    script = shutil.which("fxpar")  # the console script, where the package is installed
    if script is not None:
        done = subprocess.run([script, "check", "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and COMMANDS["check"][1] in done.stdout


def readme_commands() -> list[str]:
    """The `fxpar ...` lines of the README's code blocks (its "See the plan" section)."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("fxpar ")]


def test_every_fxpar_command_in_the_readme_runs_as_written(in_tmp, capsys):
    commands = readme_commands()
    assert {shlex.split(c)[1] for c in commands} >= {"explain", "viz", "report", "check", "estimate", "diff",
                                                     "verify"}
    for command in commands:
        if "gpt3_175b" in command:  # 30 s here; its timing is in docs/cost-model.md and the report
            continue
        status, _, err = run(capsys, *shlex.split(command)[1:])
        assert status == 0, f"{command}\n{err}"
