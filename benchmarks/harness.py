"""Side-by-side timing of fxpar and its native PyTorch peer, inside one torchrun job.

Map: `Side` (one implementation: a name and a step function), `run_interleaved` (time the
sides in alternating blocks), `Timing` (median, p10, p90 of one side), `paired_ratio`,
`reduce_over_ranks` (the post-run reductions, on the group's device), and what every
side-by-side script shares: `GPT_SIZES`, `OPTIMIZER`, `global_batches`,
`side_by_side_arguments`, `comparison`, `first_mismatch`, `distinct_storage_bytes`,
`format_table`, `timing_cell`, `progress_line`, `mismatch_message`, `write_json`.

Both sides train the same model from the same weights on the same batches, so they are
timed in one process, in turns, and machine noise (another job, frequency scaling, the
allocator warming up) lands on both alike. The schedule is blocks of `block` steps, with the
order of the sides reversed every round (A B, B A, A B, ...) so neither side always runs
right after the other:

    warm-up:  A A A  B B B                  (untimed, `warmup` steps per side)
    timed:    A A A A A  B B B B B  B B B B B  A A A A A  ...   (block=5)

Every timed step starts after a barrier, so all ranks enter it together and the time is the
step's, not the wait for a straggler's previous step. Each rank times its own steps with
`time.perf_counter`; the times are combined with an all-reduce MAX after the run (never
inside the timed region): a data-parallel step is as slow as its slowest rank.

Each step's CPU time on the rank's main thread (`time.thread_time`) is kept too, as a second,
quieter measure: time the thread spent waiting (for a collective, or for a core another
process holds) does not count, so on a shared machine it shows the work each side does on
the training thread when wall-clock medians drown in noise. Gloo's own threads are not in it.

[Note: reductions on the group's device] NCCL reduces CUDA tensors only: a default group bound
with backend "nccl" has no CPU backend, and an all-reduce of a CPU tensor on it fails ("No
backend type associated with device type cpu"; bench_gpu_zero3.py at world 1 on an H200,
2026-12-04, after its timing was done). Every reduction after a run therefore goes through
`reduce_over_ranks`, which builds its tensor on `reduction_device()`: the current CUDA device
under NCCL, the CPU under gloo (and under a "cpu:gloo,cuda:nccl" group).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPTConfig  # noqa: E402

# The GPT sizes every side-by-side benchmark uses; "medium" (3.3M parameters, 12.7 MiB of fp32
# gradients) is large enough that communication is a visible part of a step on gloo.
SEQ = 64
GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=SEQ, vocab_size=256, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(block_size=SEQ, vocab_size=256, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=SEQ, vocab_size=256, n_layer=4, n_head=8, n_embd=256),
}
# Sequences per training step of the data-parallel, ZeRO and pipeline scripts.
GLOBAL_BATCH = 16
# AdamW's settings on both sides of every CPU comparison (bench_gpu_zero3.py keeps its own).
OPTIMIZER = dict(lr=1e-3, weight_decay=0.1)


def global_batches(
    vocab_size: int, count: int, seed: int, *, batch: int = GLOBAL_BATCH
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` random (tokens, targets) pairs of shape (batch, SEQ), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randint(0, vocab_size, (batch, SEQ), generator=generator) for _ in range(2))
        for _ in range(count)
    ]


def write_json(path: Path, args, results: list, **extra) -> None:
    """Save a run: date, torch, machine, load, the arguments, the results and `extra` fields."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, gloo",
        "load_average": os.getloadavg(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **extra,
        "results": results,
    }, indent=2))


def synchronized(step: Callable[[int], object], device: torch.device) -> Callable[[int], object]:
    """`step`, returning only once the device has finished its work (so timing it is honest)."""
    def run(i: int):
        loss = step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return loss
    return run


def bench_device(name: str) -> torch.device:
    """The device `--device name` means for this rank: a GPU is the rank's own (`LOCAL_RANK`),
    made current."""
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return device


def side_by_side_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options every side-by-side script takes: --steps, --warmup, --block
    (`run_interleaved`) and --json (`write_json`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per side (>= 10)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per side first")
    parser.add_argument("--block", type=int, default=5, help="steps per side per turn")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser


def reduction_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must be to be all-reduced over `group` (the default group when None):
    the current CUDA device under NCCL, the CPU otherwise ([Note: reductions on the group's
    device])."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_over_ranks(values: Sequence, how: Literal["max", "sum", "mean"]) -> list:
    """All-reduce `values` (floats, or lists of floats, the same shape on every rank) over the
    default group, in float64 on `reduction_device()`; back as Python lists."""
    tensor = torch.tensor(values, dtype=torch.float64, device=reduction_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
    if how == "mean":
        tensor /= dist.get_world_size()
    return tensor.tolist()


@dataclass(frozen=True)
class Side:
    """One implementation under test. `step(i)` runs training step `i` and returns its loss."""

    name: str
    step: Callable[[int], float | torch.Tensor]


def module_step(model, optimizer, batches: list) -> Callable[[int], torch.Tensor]:
    """Step `i` of an eager model that returns its loss: forward, backward, optimizer step."""

    def step(i: int) -> torch.Tensor:
        loss = model(*batches[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def runner_step(runner, optimizer, batches: list) -> Callable[[int], float]:
    """Step `i` of an fxpar runner on this rank's batch `batches[i]`, then the optimizer step."""

    def step(i: int) -> float:
        loss = runner.step(*batches[i])
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


@dataclass(frozen=True)
class Timing:
    """Seconds per step over the timed steps of one side (max over ranks)."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p10(self) -> float:
        return statistics.quantiles(self.seconds, n=10, method="inclusive")[0]

    @property
    def p90(self) -> float:
        return statistics.quantiles(self.seconds, n=10, method="inclusive")[-1]

    def to_dict(self) -> dict[str, object]:
        return {
            "median_ms": 1e3 * self.median,
            "p10_ms": 1e3 * self.p10,
            "p90_ms": 1e3 * self.p90,
            "steps_ms": [1e3 * s for s in self.seconds],
        }


@dataclass(frozen=True)
class SideRun:
    """What one side did: per-step losses (warm-up included, in step order) and the timing."""

    losses: tuple[float, ...]
    timing: Timing
    cpu: Timing  # main-thread CPU seconds per step, mean over ranks


def run_interleaved(
    sides: list[Side], *, warmup: int, steps: int, block: int
) -> dict[str, SideRun]:
    """Run `warmup + steps` training steps per side, timing the last `steps` (see module doc).

    Side k runs its steps 0, 1, 2, ... in order, so each side trains exactly as it would
    alone. Every rank must call this with the same arguments.
    """
    if steps < 10 or block < 1:
        raise ValueError(f"need steps >= 10 and block >= 1, got steps={steps}, block={block}")
    losses: dict[str, list[float | torch.Tensor]] = {s.name: [] for s in sides}
    seconds: dict[str, list[float]] = {s.name: [] for s in sides}
    cpu_seconds: dict[str, list[float]] = {s.name: [] for s in sides}

    def run(side: Side, count: int, *, timed: bool) -> None:
        for _ in range(count):
            i = len(losses[side.name])
            if timed:
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.thread_time()
                loss = side.step(i)
                seconds[side.name].append(time.perf_counter() - start)
                cpu_seconds[side.name].append(time.thread_time() - cpu_start)
            else:
                loss = side.step(i)
            losses[side.name].append(loss)

    for side in sides:
        run(side, warmup, timed=False)
    round_index = 0
    while any(len(t) < steps for t in seconds.values()):
        order = sides if round_index % 2 == 0 else sides[::-1]
        for side in order:
            run(side, min(block, steps - len(seconds[side.name])), timed=True)
        round_index += 1

    return {
        side.name: SideRun(
            losses=tuple(float(x) for x in losses[side.name]),
            timing=Timing(tuple(reduce_over_ranks(seconds[side.name], "max"))),
            cpu=Timing(tuple(reduce_over_ranks(cpu_seconds[side.name], "mean"))),
        )
        for side in sides
    }


def run_models(models: Sequence[str], bench_model: Callable, args, *, native: str,
               report: Callable) -> int:
    """`bench_model(name, args) -> (result, runner)` for each model in turn, a progress line
    each, then `report(results, args)` on rank 0; exit status 1 if any side's losses differed.
    The first bind creates the process group and later binds reuse it, so the runners of
    earlier models stay open (their hooks sit on models nobody trains any more) and only the
    last is closed, which destroys the group."""
    results, runner = [], None
    for name in models:
        result, runner = bench_model(name, args)
        results.append(result)
        if runner.is_main:
            print(progress_line(name, result, native), flush=True)
    is_main = runner.is_main
    runner.close()
    if is_main:
        report(results, args)
    return 0 if all(r["losses_match"] for r in results) else 1


def paired_ratio(a: Timing, b: Timing) -> float:
    """Median over k of b's k-th timed step divided by a's k-th: steps k of the two sides run
    in adjacent blocks, so slow spells of the machine mostly cancel in each quotient."""
    return statistics.median(y / x for x, y in zip(a.seconds, b.seconds, strict=True))


def mean_over_ranks(values: tuple[float, ...]) -> tuple[float, ...]:
    """Average per-rank values (e.g. DDP's local losses) into the global-batch values."""
    return tuple(reduce_over_ranks(values, "mean"))


def sum_over_ranks(values: tuple[float, ...]) -> tuple[float, ...]:
    """Add per-rank values (e.g. each pipeline stage's share of the loss) into the global ones."""
    return tuple(reduce_over_ranks(values, "sum"))


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def first_mismatch(
    a: tuple[float, ...], b: tuple[float, ...], *, rel: float
) -> tuple[int, float, float] | None:
    """The first step whose losses differ by more than `rel` relative, or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if abs(x - y) > rel * max(abs(x), abs(y)):
            return i, x, y
    return None


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, columns right-aligned and padded to line up in a terminal too."""
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(x).rjust(w) for x, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def timing_cell(timing: dict[str, object]) -> str:
    """A `Timing.to_dict()` as a table cell: "median [p10-p90]" in ms."""
    return f"{timing['median_ms']:.1f} [{timing['p10_ms']:.1f}-{timing['p90_ms']:.1f}]"


def progress_line(what: str, result: dict, native: str, *, label: str | None = None) -> str:
    """One finished comparison (a `comparison` dict) as a line: both medians and their ratio."""
    return (f"{what}: {label or native} {result[native]['median_ms']:.1f} ms, fxpar "
            f"{result['fxpar']['median_ms']:.1f} ms, ratio {result['ratio']:.3f}")


def mismatch_message(what: str, mismatch: tuple[int, float, float], names: tuple[str, str], *,
                     rel: float) -> str:
    """The line a script prints when `first_mismatch` found a step where the sides differ."""
    step, a, b = mismatch
    return (f"ERROR {what}: losses differ at step {step}: {names[0]} {a!r} vs {names[1]} {b!r} "
            f"(> {rel:g} relative); the sides did not train alike, the comparison is void")


def comparison(runs: dict, native: str, native_losses: list[float], fx_losses: list[float],
               mismatch) -> dict:
    """The fields every side-by-side result reports: both sides' timings, the ratios, and
    whether (and how closely) the two sides trained alike."""
    fx, other = runs["fxpar"], runs[native]
    return {
        native: other.timing.to_dict(),
        "fxpar": fx.timing.to_dict(),
        "ratio": fx.timing.median / other.timing.median,
        "paired_ratio": paired_ratio(other.timing, fx.timing),
        f"{native}_cpu": other.cpu.to_dict(),
        "fxpar_cpu": fx.cpu.to_dict(),
        "cpu_ratio": fx.cpu.median / other.cpu.median,
        "losses_match": mismatch is None,
        "max_loss_relative_difference": max(
            abs(a - b) / max(abs(a), abs(b)) for a, b in zip(native_losses, fx_losses)
        ),
        "first_loss": fx_losses[0],
        "last_loss": fx_losses[-1],
    }
