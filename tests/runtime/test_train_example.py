"""Tier 3: the README's trainers run end to end under torchrun (examples/train_gpt.py and
examples/train_hf.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

TRAINER = Path(__file__).parents[2] / "examples" / "train_gpt.py"
HF_TRAINER = TRAINER.with_name("train_hf.py")


def test_trainer_runs_a_zero_bubble_pipeline_with_muon_and_prints_its_timeline(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(TRAINER), "--plan", "pp=2 mb=2 schedule=zb-h1", "--steps", "3", "--batch", "4",
        "--seq", "32", "--n-layer", "2", "--timeline", "--save", str(tmp_path / "state.pt"),
        "--optimizer", "muon", "--save-every", "3", "--checkpoint-dir", str(tmp_path / "checkpoints"),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "last step, schedule zb-h1:" in out
    chart = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(chart) == 2 and all("W" in line and "B" in line and "F" in line for line in chart)
    assert "loss " in out and " -> " in out and (tmp_path / "state.pt").exists()
    # Muon and AdamW (whole matrices under pp), both in the checkpoint
    manifest = (tmp_path / "checkpoints" / "step-00000003" / "fxpar.json").read_text()
    assert '"Muon"' in manifest and '"AdamW"' in manifest


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_hugging_face_trainer_runs_a_tensor_parallel_plan(model):
    """A transformers model from its config, unmodified, under tp=2: the loss goes down."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(HF_TRAINER), "--model", model, "--plan", "tp=2", "--steps", "8", "--batch", "4",
        "--seq", "32", "--hidden", "64", "--lr", "3e-3", "--warmup-steps", "2",
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = next(line for line in done.stdout.splitlines() if line.startswith("loss "))
    first, last = (float(x) for x in summary.split(" over ")[0][len("loss "):].split(" -> "))
    assert last < first, summary
    assert "all_reduce" in summary  # rank 0 communicated: the plan really split the model
