"""Shared fixtures: launching torchrun workers for the multi-rank tiers, and a real gloo group
of this process alone for runtime pieces tested in one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

WORKERS = Path(__file__).parent / "workers"
# Every pass checks its written contract after it runs (passes.contracts), here and in the
# torchrun workers the tests launch, which inherit the environment.
os.environ["FXPAR_CHECK_PASSES"] = "1"


def launch_torchrun(
    out_dir: Path, script: str, nproc: int, *args: str, timeout: float = 300, env: dict | None = None
) -> list:
    """Run `tests/workers/<script>` under torchrun with `nproc` gloo ranks; load each rank's file.

    The worker gets `out_dir` as its first argument and saves `rank{r}.pt` there.
    """
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(WORKERS / script), str(out_dir), *args,
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
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture
def torchrun(tmp_path):
    """`launch_torchrun` into this test's folder: `(script, nproc, *args) -> per-rank results`.

    A module that asserts many things of one launch uses `module_torchrun` instead.
    """
    return partial(launch_torchrun, tmp_path)


@pytest.fixture(scope="module")
def module_torchrun(tmp_path_factory):
    """`torchrun` for a module-scoped fixture: one launch whose results several tests read."""
    return partial(launch_torchrun, tmp_path_factory.mktemp("torchrun"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def world_of_one():
    """The default process group of a world of one (gloo, an in-memory store, a 10 s timeout),
    destroyed after the test: real collectives, each with itself as the only peer."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def torchrun_world_of_one(monkeypatch):
    """The environment torchrun gives a world of one (a free port), for `program.bind()` in
    this process; torchrun's variables come back after the test."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
