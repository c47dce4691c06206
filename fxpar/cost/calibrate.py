"""Measure the `cpu` hardware profile on the running machine, once, and cache it.

Microbenchmarks at this process' torch thread count, a few seconds in all:

* matmul rate: a 512^3 fp32 matmul (the profile's peak, for MFU); and the matmul table
  (`cost.matmul_table`): fp32 `torch.mm` at every (m, k, n) of `TABLE_SIZES`, each the best of
  three medians less the dispatch of a 1 x 1 x 1 mm (the estimate charges `op_overhead` per
  op besides). On one EPYC core it read 67-103 GFLOP/s over the grid;
* memory bandwidth: a 64 MiB tensor copy (bytes read plus written per second);
* attention rate: causal `scaled_dot_product_attention`, forward and backward, at batch 8,
  8 heads, sequence 128, head dim 32, with FLOPs counted as `cost.ops` counts them
  (3 x 4 b h s^2 d, no causal discount). The rate depends on the shape: on a 1-thread EPYC
  core it was 0.40 of the matmul rate at head dim 16, 0.52 at 32 and 0.65 at 64 (seq 256);
* elementwise bandwidths: a transformer's non-matmul ops, forward and backward, at 4096
  tokens, width 128, vocabulary 256, one class at a time (`CLASSES`: a residual add, GELU on
  the 4x-wide hidden, layer_norm, cross-entropy on the logits), their bytes counted as
  `cost.ops` counts them (inputs plus output, backward = 2x forward): `Hardware.bandwidths`.
  All together over the copy bandwidth are
  `elementwise_efficiency`, which prices the other copies (embedding lookups, concatenations);
* op overhead: a pre-norm transformer block (`TinyBlock`: nanoGPT's, at width 8 over 4
  tokens, so that its kernels take next to no time) forward then backward, per op as the
  estimate counts ops (`cost.ops.op_counts` of its captured graph: `TinyBlock.COUNTED`): the
  fixed cost of an eager op as a model's ops pay it. A linear dispatches a view, a transpose and
  an addmm, its backward two mms and a sum; a chain of 1-element adds, which this once was,
  read 2.2 us an op where the block reads 9 (one EPYC core);
* optimizer tensor overhead: a `torch.optim.AdamW` step over 128 tensors of 1024 elements,
  with a small MLP's forward and backward and a 64 MiB copy run between steps, so that the
  step starts with caches as cold as in training (back to back it runs about 40% faster);
  minus the step's bytes as `cost.optimizer` charges them, per tensor;
* gloo link: two child processes (`python -m fxpar.cost.calibrate --link-worker`) all-reduce
  a 1-element and a 4 MiB tensor; a 2-rank ring all-reduce is 2 alpha + M / bandwidth, so the
  small one gives alpha and the large one the bandwidth. Children, not `multiprocessing`:
  spawn would re-import the caller's script, which breaks scripts without a
  `if __name__ == "__main__":` guard;
* a call's wait for its peers (`Link.wait`): the same two children run a burst of matmuls
  (about a millisecond) and then the 1-element all-reduce; what that costs beyond the burst
  alone and the all-reduce alone is `sync_wait`. The children are 2 x cores (where that is at
  most `_MOST_SHARED`), the others idle meanwhile; then all of them measure the same as one
  group: `shared_wait`, the wait of ranks that take turns on the cores (`Hardware.shared_by`).

Robustness. Noise on a shared machine only ever slows a run down, so each reading warms up
for a fixed time (0.3 s; a fixed number of calls for the collectives, which must match on both
ranks), then takes the best of five medians. The rounds of the six compute readings take
turns (matmul, copy, attention, elementwise, op, optimizer, matmul, ...), so that each
reading's medians come from moments about a second apart, not from one burst another process may have
slowed down throughout. A profile measured while the machine is
loaded (1-minute load average above the cores this process may run on) is returned but not
cached, with a warning: a 2.5x slow reading once cached would skew every estimate for good.
The cache is written atomically (a temporary file, then `os.replace`).

The cache is JSON under `$FXPAR_CACHE_DIR` (default `~/.cache/fxpar`), keyed by the thread
count, the torch version and `METHOD`, the version of these probes (a reading an older probe
took means something else); a file that lacks a reading is measured again.
`python -m fxpar.cost.calibrate` measures and prints the profile; `-o FILE.json` also writes
it as a profile file (`cost.profile_files`) that `estimate`, `compile` and the CLI take.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxpar.cost.hardware import NOMINAL_CPU, Hardware, Link
from fxpar.cost.matmul_table import MatmulTable
from fxpar.cost.optimizer import BYTES_PER_PARAMETER
from fxpar.cost.profile_files import is_profile_file, save_profile

log = logging.getLogger(__name__)

CLASSES = ("pointwise", "activation", "norm", "loss")  # memory-bound classes measured apart (`_elementwise`)
READINGS = ("matmul_flops", "memory_bandwidth", "attention_flops", "elementwise_bandwidth",
            "op_overhead", "optimizer_tensor_overhead", "alpha", "link_bandwidth", "sync_wait",
            "shared_wait", "matmul_table", *(f"{kind}_bandwidth" for kind in CLASSES))
METHOD = 3  # the probes' version, in the cache's key: raise it when a probe measures anew
# The matmul table's grid: m (tokens, rows) wider than k and n (the widths of small models).
TABLE_SIZES = {"m": (64, 256, 1024, 4096), "k": (64, 256, 1024), "n": (64, 256, 1024)}
_SMALL, _LARGE = 1, 2**20  # all-reduce payloads in fp32 elements: 4 bytes and 4 MiB
_WARMUP_SECONDS = 0.3
_MOST_SHARED = 16  # processes the shared wait is measured with at most (2 x cores)


def cache_file(threads: int) -> Path:
    root = Path(os.environ.get("FXPAR_CACHE_DIR", Path.home() / ".cache" / "fxpar"))
    return root / f"hardware-cpu-{threads}threads-torch{torch.__version__}-method{METHOD}.json"


@functools.cache
def measure_cpu() -> Hardware:
    """The measured `cpu` profile (see module doc)."""
    threads = torch.get_num_threads()
    cache = cache_file(threads)
    readings = json.loads(cache.read_text()) if cache.is_file() else {}
    if not all(key in readings for key in READINGS):
        readings = calibrate_cpu()
        if readings["load_average"] > readings["cores"]:
            log.warning(
                "fxpar: the cpu profile was measured under load (1-minute load average %.1f "
                "on %d cores); using it but not caching it, so the next process measures again",
                readings["load_average"], readings["cores"],
            )
        else:
            write_cache(readings, cache)
    return profile_of(readings)


def profile_of(readings: dict[str, float]) -> Hardware:
    """The `cpu` Hardware for a set of readings (the values `calibrate_cpu` returns)."""
    link = Link(alpha=readings["alpha"], bandwidth=readings["link_bandwidth"], wait=readings["sync_wait"])
    table = MatmulTable(tuple(map(tuple, readings["matmul_table"])))
    return replace(
        NOMINAL_CPU,
        peak_flops={"fp32": readings["matmul_flops"], "bf16": readings["matmul_flops"]},
        matmul_efficiency=1.0,
        matmul_tables={"fp32": table, "bf16": table},  # bf16 priced as fp32, as its peak is
        memory_bandwidth=readings["memory_bandwidth"],
        attention_efficiency=readings["attention_flops"] / readings["matmul_flops"],
        elementwise_efficiency=readings["elementwise_bandwidth"] / readings["memory_bandwidth"],
        bandwidths={kind: readings[f"{kind}_bandwidth"] for kind in CLASSES},  # copies: the efficiency's
        op_overhead=readings["op_overhead"],
        optimizer_tensor_overhead=readings["optimizer_tensor_overhead"],
        comm_overlap=0.0,  # gloo's thread shares the cores with compute (hardware.py)
        cores=int(readings["cores"]) if "cores" in readings else None,  # (a cache of an older fxpar's)
        threads=int(readings.get("threads", 1)),
        shared_wait=readings["shared_wait"],
        intra_node=link,
        inter_node=link,
        measured=readings,
    )


def calibrate_cpu() -> dict[str, float]:
    """Run every microbenchmark now (no cache); readings plus the load they were taken under."""
    load = os.getloadavg()[0]
    probes = {
        "matmul": _matmul(),
        "copy": _copy(),
        "attention": _attention(),
        **{f"{kind}_elementwise": probe for kind, probe in _elementwise().items()},
        "op": _op_block(),
        "optimizer": _optimizer_step(),
    }
    seconds = _best_seconds({name: probe[0] for name, probe in probes.items()},
                            before={"optimizer": probes["optimizer"][1]})
    work = {name: probe[-1] for name, probe in probes.items()}
    bandwidth = work["copy"] / seconds["copy"]
    tensors, parameters = work["optimizer"]
    streamed = parameters * BYTES_PER_PARAMETER["adamw"] / bandwidth
    readings = {
        "matmul_flops": work["matmul"] / seconds["matmul"],
        "memory_bandwidth": bandwidth,
        "attention_flops": work["attention"] / seconds["attention"],
        **{f"{kind}_bandwidth": work[f"{kind}_elementwise"] / seconds[f"{kind}_elementwise"] for kind in CLASSES},
        "elementwise_bandwidth": (sum(work[f"{kind}_elementwise"] for kind in CLASSES)
                                  / sum(seconds[f"{kind}_elementwise"] for kind in CLASSES)),
        "op_overhead": seconds["op"] / work["op"],
        # What the step costs beyond the bytes `cost.optimizer` charges, per tensor.
        "optimizer_tensor_overhead": max(seconds["optimizer"] - streamed, 0.0) / tensors,
        "threads": torch.get_num_threads(),
        "matmul_table": _matmul_table(),
    }
    readings["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    readings["load_average"] = max(load, os.getloadavg()[0])  # before the link's ranks load the cores
    shared = 2 * readings["cores"]
    readings.update(_gloo_link(shared if shared <= _MOST_SHARED else 2))
    return readings


def write_cache(readings: dict[str, float], cache: Path | None = None) -> Path:
    """Write `readings` to the cache file (default: this thread count's), atomically."""
    cache = cache or cache_file(torch.get_num_threads())
    cache.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=cache.parent, prefix=cache.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(readings, out, indent=1)
        os.replace(temporary, cache)
    except BaseException:
        os.unlink(temporary)
        raise
    return cache


def _best_seconds(
    runs: dict[str, Callable[[], object]],
    *,
    before: dict[str, Callable[[], object]] | None = None,
    repeats: int = 7,
    rounds: int = 5,
) -> dict[str, float]:
    """Seconds of one call of each of `runs`: the best of `rounds` medians of `repeats` calls.

    Each is first warmed up for `_WARMUP_SECONDS`; then the rounds take turns over `runs`.
    `before[name]`, where given, runs ahead of every call of `runs[name]`, untimed.
    """
    before = before or {}
    for name, fn in runs.items():
        prepare = before.get(name, lambda: None)
        deadline = time.perf_counter() + _WARMUP_SECONDS
        while time.perf_counter() < deadline:
            prepare()
            fn()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            prepare = before.get(name, lambda: None)
            times = []
            for _ in range(repeats):
                prepare()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            best[name] = min(best[name], statistics.median(times))
    return best


# Each probe: (the call to time, [what runs before it, untimed,] the work one call does).


def _matmul(n: int = 512) -> tuple:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return (lambda: torch.mm(a, b)), 2 * n**3  # FLOPs


def _matmul_table(rounds: int = 3, repeats: int = 3) -> list[list[float]]:
    """[m, k, n, FLOP/s] at every shape of `TABLE_SIZES` (module doc): a light loop of its own,
    not `_best_seconds`, whose fixed warm-up per run would take 11 s over 36 shapes. The rounds
    go over every shape in turn, so that each shape's medians are moments apart."""
    shapes = [(m, k, n) for m in TABLE_SIZES["m"] for k in TABLE_SIZES["k"] for n in TABLE_SIZES["n"]]
    operands = {(m, k, n): (torch.randn(m, k), torch.randn(k, n)) for m, k, n in shapes}
    one = torch.ones(1, 1)

    def median_seconds(a, b) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    for a, b in operands.values():  # warm-up: first touches, MKL's first calls
        torch.mm(a, b)
    dispatch = min(median_seconds(one, one) for _ in range(rounds))
    best = dict.fromkeys(shapes, float("inf"))
    for _ in range(rounds):
        for shape, (a, b) in operands.items():
            best[shape] = min(best[shape], median_seconds(a, b))
    return [[m, k, n, 2 * m * k * n / max(best[m, k, n] - dispatch, best[m, k, n] / 2)] for m, k, n in shapes]


def _copy(numel: int = 2**24) -> tuple:
    src, dst = torch.randn(numel), torch.empty(numel)
    return (lambda: dst.copy_(src)), 2 * 4 * numel  # bytes read and written


def _attention(batch: int = 8, heads: int = 8, seq: int = 128, head_dim: int = 32) -> tuple:
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim)

    def forward_backward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return forward_backward, 3 * 4 * batch * heads * seq**2 * head_dim  # `cost.ops` FLOPs


def _elementwise(tokens: int = 4096, width: int = 128, vocabulary: int = 256) -> dict[str, tuple]:
    """One probe per class of memory-bound op (`cost.ops.BYTE_KINDS` but copies): pointwise
    (a residual add), activation (GELU on the 4x-wide hidden), norm (layer_norm), loss
    (cross-entropy over the logits), each forward and backward, and its bytes as `cost.ops`
    counts them (inputs plus output, backward = 2x forward)."""
    x = torch.randn(tokens, width, requires_grad=True)
    hidden = torch.randn(tokens, 4 * width, requires_grad=True)
    logits = torch.randn(tokens, vocabulary, requires_grad=True)
    weight, bias = torch.ones(width, requires_grad=True), torch.zeros(width, requires_grad=True)
    targets = torch.randint(0, vocabulary, (tokens,))
    grad_x, grad_hidden = torch.randn(tokens, width), torch.randn(tokens, 4 * width)

    def moved(*tensors):  # `cost.ops`: the op's tensor inputs plus its output
        return sum(t.nbytes for t in tensors)

    return {
        "pointwise": (lambda: (x + x).backward(grad_x), 3 * moved(x, x, x)),
        "activation": (lambda: F.gelu(hidden).backward(grad_hidden), 3 * moved(hidden, hidden)),
        "norm": (lambda: F.layer_norm(x, (width,), weight, bias).backward(grad_x), 3 * moved(x, weight, bias, x)),
        "loss": (lambda: F.cross_entropy(logits, targets).backward(), 3 * (moved(logits, targets) + 4)),
    }


class TinyBlock(torch.nn.Module):
    """nanoGPT's pre-norm transformer block and a loss, at toy sizes: the op overhead's probe."""

    COUNTED = 20 + 32  # forward ops + backward nodes, as `cost.ops.op_counts` counts its graph

    def __init__(self, width: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).contiguous().view(b, t, c))
        x = x + self.out(F.gelu(self.fc(self.norm2(x))))
        return x.square().mean()


def _op_block(tokens: int = 4) -> tuple:
    block, x = TinyBlock(), torch.randn(1, tokens, 8)
    return (lambda: block(x).backward()), TinyBlock.COUNTED


def _optimizer_step(tensors: int = 128, numel: int = 1024) -> tuple:
    parameters = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(tensors)]
    for p in parameters:
        p.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.1)
    mlp = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                for _ in range(8)))
    x, src, dst = torch.randn(64, 64), torch.randn(2**24), torch.empty(2**24)

    def training_between():  # what a training step does between two optimizer steps
        mlp(x).sum().backward()
        dst.copy_(src)

    return optimizer.step, training_between, (tensors, tensors * numel)


def _best_collective_seconds(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):  # a count, not a time: both ranks must issue the same calls
        fn()
    medians = []
    for _ in range(3):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians)


def _mean_seconds(fn: Callable[[], object], group=None, calls: int = 100) -> float:
    """Mean seconds of a call of `fn` over `calls` in a row, the median of three such runs
    (warmed up by the first). A mean, not `_best_collective_seconds`' best median: a wait for
    peers is the ranks' jitter itself, which the best of several readings would leave out."""
    means = []
    for _ in range(4):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means[1:])


def _link_worker(rank: int, world: int, store_path: str, out_path: str) -> None:
    """One rank of `world`: ranks 0 and 1 measure the link's alpha and bandwidth and the wait
    of a call that follows compute while the others wait; then, with more than two, every
    rank measures that wait again, taking turns on the cores (module doc). Rank 0 writes the
    readings to `out_path`."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    pair = dist.new_group([0, 1])
    readings = {}
    if rank < 2:
        t_large = _best_collective_seconds(lambda: dist.all_reduce(torch.zeros(_LARGE), group=pair),
                                           warmup=3, repeats=7)
        t_small, wait = _wait_after_compute(pair)
        alpha = t_small / 2  # 2(n-1) = 2 latency steps for n = 2
        wire = 4 * _LARGE  # 2(n-1)/n x M = M for n = 2
        readings = {"alpha": alpha, "link_bandwidth": wire / max(t_large - 2 * alpha, 1e-9), "sync_wait": wait}
    dist.barrier()
    readings["shared_wait"] = _wait_after_compute(None)[1] if world > 2 else None
    if rank == 0:
        Path(out_path).write_text(json.dumps(readings))
    dist.destroy_process_group()


def _wait_after_compute(group) -> tuple[float, float]:
    """Over `group` (None: every rank), a 1-element all-reduce's seconds back to back, and
    what one costs after a burst of matmuls beyond the burst and that (module doc)."""
    small = torch.zeros(_SMALL)
    a, b = torch.randn(192, 192), torch.randn(192, 192)

    def burst():  # about a millisecond of matmuls on one thread, the same on every rank
        for _ in range(4):
            torch.mm(a, b)

    t_small = _best_collective_seconds(lambda: dist.all_reduce(small, group=group), warmup=20, repeats=30)
    t_burst = _mean_seconds(burst, group)
    t_after = _mean_seconds(lambda: (burst(), dist.all_reduce(small, group=group)), group)
    return t_small, max(t_after - t_burst - t_small, 0.0)


def _gloo_link(world: int = 2, timeout: float = 120) -> dict[str, float]:
    """`_link_worker`'s readings from `world` child processes (`shared_wait` None at 2)."""
    with tempfile.TemporaryDirectory() as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "link.json")
        children = [
            subprocess.Popen(
                [sys.executable, "-m", "fxpar.cost.calibrate", "--link-worker", str(rank), str(world),
                 store, out],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for rank in range(world)
        ]
        outputs = []
        try:
            for child in children:
                outputs.append(child.communicate(timeout=timeout)[0])
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        if any(child.returncode != 0 for child in children) or not os.path.exists(out):
            raise RuntimeError("fxpar: the gloo link calibration failed:\n" + "\n".join(outputs))
        return json.loads(Path(out).read_text())


def main(argv: list[str]) -> int:
    """`python -m fxpar.cost.calibrate [-o FILE.json]`: measure this machine (or read the cache)
    and print the readings; with -o also write the profile file estimates can be given
    (`cost.profile_files`)."""
    if argv[:1] == ["--link-worker"]:
        rank, world, store, out = argv[1:5]
        _link_worker(int(rank), int(world), store, out)
        return 0
    parser = argparse.ArgumentParser(prog="python -m fxpar.cost.calibrate", description=main.__doc__)
    parser.add_argument("-o", "--output", help="write the profile here (a .json file)")
    args = parser.parse_args(argv)
    if args.output is not None and not is_profile_file(args.output):
        parser.error(f"-o {args.output!r}: a profile file's name ends in .json")
    profile = measure_cpu()
    print(json.dumps(profile.measured, indent=1))
    if args.output is not None:
        print(f"wrote {save_profile(profile, args.output)}; price with it: program.estimate({args.output!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
