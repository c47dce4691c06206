"""Shared fixtures: launching torchrun workers for the multi-rank tiers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).parent / "workers"
# Every pass checks its written contract after it runs (passes.contracts), here and in the
# torchrun workers the tests launch, which inherit the environment.
os.environ["FXPAR_CHECK_PASSES"] = "1"


@pytest.fixture
def torchrun(tmp_path):
    """Run `tests/workers/<script>` under torchrun with `nproc` gloo ranks; load each rank's file.

    Returns a function `(script, nproc, *args) -> list[per-rank results]`: the worker gets
    the output folder as its first argument and saves `rank{r}.pt` there.
    """

    def launch(
        script: str, nproc: int, *args: str, timeout: float = 300, env: dict | None = None
    ) -> list:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(WORKERS / script), str(tmp_path), *args,
        ]
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env, cwd=WORKERS
        )
        if done.returncode != 0:
            raise AssertionError(
                f"torchrun {script} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-6000:]}"
            )
        return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(nproc)]

    return launch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
