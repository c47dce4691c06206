"""Where a tensor-parallel step spends its time: forward/backward/optimizer breakdown, profiles,
and the per-op dispatch overhead of DTensor against plain tensors.

Used by `bench_tp.py` (`--breakdown N`, `--profile`).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harness import reduce_over_ranks


def breakdown(sides: dict, batches: list, repeats: int) -> dict:
    """Per side, median ms of each phase of a step: wall (max over ranks) and main-thread CPU
    (`time.thread_time`, mean over ranks, which leaves out waiting for the peer).

    Phases: `fwd+bwd` (DTensor: `model(x, y).backward()`; fxpar: `runner.step`), of it
    `forward` for DTensor alone, and `optimizer` (`step` + `zero_grad`). The sides keep
    training (these steps come after the compared ones): one step of each side in turn,
    `repeats` times, a barrier before each phase.
    """
    import statistics

    phases = ("forward", "fwd+bwd", "optimizer")
    wall = {s: {p: [] for p in phases} for s in sides}
    cpu = {s: {p: [] for p in phases} for s in sides}

    def clock() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def record(side: str, phase: str, start: tuple[float, float]) -> None:
        end = clock()
        wall[side][phase].append(end[0] - start[0])
        cpu[side][phase].append(end[1] - start[1])

    for i in range(repeats):
        x, y = batches[i % len(batches)]
        for side, (model, optimizer, runner) in sides.items():
            dist.barrier()
            start = clock()
            if runner is None:
                loss = model(x, y)
                record(side, "forward", start)
                loss.backward()
            else:
                runner.step(x, y)
            record(side, "fwd+bwd", start)
            dist.barrier()
            start = clock()
            optimizer.step()
            optimizer.zero_grad()
            record(side, "optimizer", start)

    out = {}
    for side in sides:
        out[side] = {}
        for phase in phases:
            if not wall[side][phase]:
                continue
            w = reduce_over_ranks(wall[side][phase], "max")
            c = reduce_over_ranks(cpu[side][phase], "mean")
            out[side][phase] = {"wall_ms": 1e3 * statistics.median(w),
                                "cpu_ms": 1e3 * statistics.median(c)}
    return out


def profile_sides(name: str, sides: dict, batches: list, is_main: bool) -> None:
    """torch.profiler over 3 steps of each side, and cProfile over 3 DTensor steps (rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    def one(side: str, i: int) -> None:
        model, optimizer, runner = sides[side]
        x, y = batches[i % len(batches)]
        if runner is None:
            model(x, y).backward()
        else:
            runner.step(x, y)
        optimizer.step()
        optimizer.zero_grad()

    for side in sides:
        one(side, 0)  # warm
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(3):
                one(side, i)
        if is_main:
            events = prof.key_averages()
            aten = sum(e.count for e in events if e.key.startswith("aten::"))
            subclass = sum(e.count for e in events if e.key == "PythonSubclass")
            print(f"\n== torch.profiler, {name}, {side}, 3 steps, rank 0, by self CPU time "
                  f"(per step: {aten / 3:.0f} aten ops, {subclass / 3:.0f} DTensor "
                  "dispatches; self time of a wait is time spent waiting for the peer) ==")
            print(events.table(sort_by="self_cpu_time_total", row_limit=18))
    dispatch_overhead(sides["dtensor"][0], is_main)
    for side in ("dtensor", "fxpar"):
        dist.barrier()
        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(3):
            one(side, i)
        profiler.disable()
        if is_main:
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            print(f"\n== cProfile, {name}, {side}, 3 steps, rank 0, by own time ==")
            print(text.getvalue()[-9000:])
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("cumulative").print_stats(30)
            print(f"\n== cProfile, {name}, {side}, 3 steps, rank 0, by cumulative time ==")
            print(text.getvalue()[-9000:])


def dispatch_overhead(model: torch.nn.Module, is_main: bool, calls: int = 2000) -> None:
    """CPU microseconds of one in-place op (`mul_`, AdamW's kind) on a DTensor parameter and
    on its local shard: the fixed cost DTensor adds to every op on its tensors."""
    param = next(p for p in model.parameters() if isinstance(p, DTensor))
    timings = {}
    with torch.no_grad():
        for label, tensor in (("DTensor", param), ("local tensor", param.to_local())):
            for _ in range(100):
                tensor.mul_(1.0)
            start = time.thread_time()
            for _ in range(calls):
                tensor.mul_(1.0)
            timings[label] = 1e6 * (time.thread_time() - start) / calls
    if is_main:
        shape = tuple(param.to_local().shape)
        print(f"\n== one mul_ on a {shape} shard: DTensor {timings['DTensor']:.1f} us, local "
              f"tensor {timings['local tensor']:.1f} us (main-thread CPU, rank 0) ==")
