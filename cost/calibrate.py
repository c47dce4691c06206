"""Measure the `cpu` hardware profile on the running machine, once, and cache it.

Three microbenchmarks, each a median of repeats, a few seconds in all:

* matmul rate: a square fp32 matmul at this process' torch thread count;
* memory bandwidth: a large tensor copy (bytes read plus written per second);
* gloo link: two processes all-reduce a 1-element and a 4 MiB tensor; a 2-rank ring
  all-reduce is 2 alpha + M / bandwidth, so the small one gives alpha and the large one the
  bandwidth.

The result is cached as JSON under `$FXPAR_CACHE_DIR` (default `~/.cache/fxpar`), keyed by
the thread count, and in memory for the life of the process.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxpar.cost.hardware import NOMINAL_CPU, Hardware, Link

_SMALL, _LARGE = 1, 2**20  # all-reduce payloads in fp32 elements: 4 bytes and 4 MiB


def _cache_file(threads: int) -> Path:
    root = Path(os.environ.get("FXPAR_CACHE_DIR", Path.home() / ".cache" / "fxpar"))
    return root / f"hardware-cpu-{threads}threads-torch{torch.__version__}.json"


@functools.cache
def measure_cpu() -> Hardware:
    """The measured `cpu` profile (see module doc)."""
    threads = torch.get_num_threads()
    cache = _cache_file(threads)
    if cache.is_file():
        readings = json.loads(cache.read_text())
    else:
        readings = {
            "matmul_flops": _matmul_rate(),
            "memory_bandwidth": _copy_bandwidth(),
            **_gloo_link(),
            "threads": threads,
        }
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(readings, indent=1))
    link = Link(alpha=readings["alpha"], bandwidth=readings["link_bandwidth"])
    return replace(
        NOMINAL_CPU,
        peak_flops={"fp32": readings["matmul_flops"], "bf16": readings["matmul_flops"]},
        matmul_efficiency=1.0,
        memory_bandwidth=readings["memory_bandwidth"],
        intra_node=link,
        inter_node=link,
        measured=readings,
    )


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_rate(n: int = 512) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b))


def _copy_bandwidth(numel: int = 2**24) -> float:
    src, dst = torch.randn(numel), torch.empty(numel)
    return 2 * 4 * numel / _median_seconds(lambda: dst.copy_(src))


def _gloo_worker(rank: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    small, large = torch.zeros(_SMALL), torch.zeros(_LARGE)
    t_small = _median_seconds(lambda: dist.all_reduce(small), repeats=50)
    t_large = _median_seconds(lambda: dist.all_reduce(large), repeats=9)
    if rank == 0:
        alpha = t_small / 2  # 2(n-1) = 2 latency steps for n = 2
        wire = 4 * _LARGE  # 2(n-1)/n x M = M for n = 2
        bandwidth = wire / max(t_large - 2 * alpha, 1e-9)
        Path(out_path).write_text(json.dumps({"alpha": alpha, "link_bandwidth": bandwidth}))
    dist.destroy_process_group()


def _gloo_link() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "link.json")
        mp.start_processes(_gloo_worker, args=(store, out), nprocs=2, start_method="spawn")
        return json.loads(Path(out).read_text())


