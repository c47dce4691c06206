"""The benchmarks' shared harness and their imports, checked without running a benchmark.

`benchmarks/` is not a package: each script puts its folder on sys.path and imports its
neighbours by name (`harness`, `bubble`, ...). The harness is loaded here from its file.

The reduction tests are about [Note: reductions on the group's device] in
`benchmarks/harness.py`: on a real H200, `bench_gpu_zero3.py` at world 1 crashed after its
timing because `run_interleaved` all-reduced a CPU tensor on an NCCL-only group. No NCCL
runs on this CPU machine, so the fix is checked in its two halves: under NCCL the reduction
device is the current CUDA device (the backend faked), and every post-run reduction of the
harness builds its tensor on the device `reduction_device` names (a real gloo world of one).
That NCCL then accepts the reduction is checked only on a GPU (`benchmarks/gpu_check.sh` runs
`bench_gpu_zero3.py` at world 1).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_harness():
    spec = importlib.util.spec_from_file_location("fxpar_benchmarks_harness",
                                                  BENCHMARKS / "harness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


harness = _load_harness()


@pytest.mark.parametrize(("backend", "expected"), [
    ("gloo", torch.device("cpu")),
    ("nccl", torch.device("cuda", 3)),
    ("cpu:gloo,cuda:nccl", torch.device("cpu")),  # a group with a CPU backend reduces there
])
def test_reduction_device_follows_the_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend(backend))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert harness.reduction_device() == expected


def test_post_run_reductions_build_their_tensor_on_the_reduction_device(world_of_one, monkeypatch):
    """run_interleaved, mean_over_ranks and sum_over_ranks each ask `reduction_device` for
    every tensor they all-reduce, and reduce it there; the values come back unchanged at
    world 1."""
    asked, reduced = [], []
    real_device, real_all_reduce = harness.reduction_device, dist.all_reduce

    def device(group=None):
        asked.append(real_device(group))
        return asked[-1]

    def all_reduce(tensor, *args, **kwargs):
        reduced.append(tensor.device)
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(harness, "reduction_device", device)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    runs = harness.run_interleaved([harness.Side("a", float), harness.Side("b", lambda i: 2.0 * i)],
                                   warmup=1, steps=10, block=5)
    assert harness.mean_over_ranks((1.0, 2.0)) == (1.0, 2.0)
    assert harness.sum_over_ranks((3.0,)) == (3.0,)
    assert runs["b"].losses == tuple(2.0 * i for i in range(11))
    assert len(runs["a"].timing.seconds) == 10
    assert reduced and reduced == asked, (
        f"tensors all-reduced on {reduced}; reduction_device named {asked} (one per reduction)"
    )


def _local_imports(path: Path, local: set[str]) -> set[str]:
    """The benchmark modules `path` imports, anywhere in the file (TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & local - {path.stem}


def test_benchmark_imports_form_no_cycle():
    """A cycle (as bench_pipeline.py <-> bubble.py once was) makes the order of two modules'
    top-level code matter; every benchmark file also has to parse."""
    files = {p.stem: p for p in sorted(BENCHMARKS.glob("*.py"))}
    graph = {name: _local_imports(path, set(files)) for name, path in files.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = trail[trail.index(name):] + [name]
            pytest.fail("benchmarks import in a cycle: " + " -> ".join(cycle)
                        + "; move what both need into a module that imports neither")
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*trail, name])
        done.add(name)

    for name in graph:
        visit(name, [])
    assert "harness" in graph and graph["harness"] == set(), graph.get("harness")
