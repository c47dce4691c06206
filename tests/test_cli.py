"""The `fxpar` command line: every command, its errors and exit status, and the README's commands.

Commands run in this process through `fxpar.cli.main` (what the console script and
`python -m fxpar` call), so torch is imported once; one test runs `python -m fxpar` itself to
check the entry point, the exit status and that a usage error prints no traceback.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fxpar.cli import COMMANDS, main

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
    """What keeps `fxpar explain` on the 175B shape at 1024 ranks near 30 s (README): it
    never matches every rank's collectives, and asks for one rank's only."""
    import fxpar.program

    asked = []
    collectives = fxpar.program.Program.collectives
    monkeypatch.setattr(fxpar.program.Program, "check", lambda self: pytest.fail("explain ran check()"))
    monkeypatch.setattr(fxpar.program.Program, "collectives",
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
    import fxpar.program

    def mismatch(self):  # what check() raises for a plan whose ranks would hang
        raise fxpar.PlanError("collective #3 on process group [0, 1] does not match")

    monkeypatch.setattr(fxpar.program.Program, "check", mismatch)
    status, _, err = run(capsys, "check", *SMALL, "--plan", "dp=2")
    assert status == 1 and err.startswith("fxpar check: FAILED: collective #3 on process group [0, 1]")


def test_estimate_and_diff(in_tmp, capsys):
    status, out, _ = run(capsys, "estimate", *SMALL, "--plan", "dp=2", "--hardware", "a100", "--optimizer", "sgd")
    assert status == 0 and out.startswith("fxpar estimate: plan 'dp=2' on a100, sgd")
    status, out, _ = run(capsys, "diff", "dp=2", "tp=2", *SMALL)
    assert status == 0 and "+ rank 0 per step: all_reduce tp all_reduce" in out


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
    (["viz", *SMALL, "--plan", "dp=2", "-o", "g.jpg"], "use one of .svg, .png, .pdf"),
    (["viz", *SMALL, "--plan", "dp=2", "--expand", "h.7"], "names no module"),
    (["explain", *SMALL, "--plan", "dp=2", "--rank", "2"], "ranks 0..1"),
    (["estimate", *SMALL, "--plan", "dp=2", "--hardware", "tpu"], "known profiles are cpu"),
    (["verify", "--hf", "llama", "--plan", "dp=2"], "--hf builds it on the meta device without weights"),
])
def test_usage_errors_exit_2_with_what_was_wrong_and_the_fix(in_tmp, capsys, argv, message):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert re.search(message, err), err
    assert err.startswith(f"fxpar {argv[0]}: error: ") and "Traceback" not in err


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
        if "gpt3_175b" in command:  # 30 s here; its timing is in the README and the report
            continue
        status, _, err = run(capsys, *shlex.split(command)[1:])
        assert status == 0, f"{command}\n{err}"
