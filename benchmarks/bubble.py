"""The measured pipeline bubble: timelines, transfer waits, and the simulator's rules replayed.

Used by `bench_pipeline.py` (its docstring, part 2, says what each number means). The torch
side it measures is `torch_pipeline.TorchPipeline`: this module imports that one (for a type)
and never `bench_pipeline.py`, which imports both, so the imports form no cycle.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fxpar.schedule.schedules import Action
from fxpar.schedule.simulation import simulate

if TYPE_CHECKING:
    from torch_pipeline import TorchPipeline


class ReceiveWaits:
    """Wraps this runner's `communicator.exchange` so that waiting for each posted receive is
    timed: `spans` holds (start, end) of every wait.

    An instance attribute shadows the method on this one benchmark's communicator only."""

    def __init__(self, communicator):
        self.spans: list[tuple[float, float]] = []
        exchange = communicator.exchange

        def timed_exchange(rank, transfers):
            pending = exchange(rank, transfers)
            return [
                [TimedWait(p, self.spans) for p in waits] if t.kind == "recv" else waits
                for t, waits in zip(transfers, pending)
            ]

        communicator.exchange = timed_exchange


class TimedWait:
    def __init__(self, pending, spans: list[tuple[float, float]]):
        self.pending, self.spans = pending, spans

    def wait(self) -> None:
        start = time.perf_counter()
        try:
            self.pending.wait()
        finally:
            self.spans.append((start, time.perf_counter()))


def fxpar_bubble(runner, optimizer, program, batches, steps: int, warmup: int,
                 ping_ms: float) -> dict:
    """Run `warmup + steps` fxpar steps recording timelines; the measured and simulated bubble.

    A rank idles while it waits for a peer's data, and before its first and after its last
    action of the step; everything else it does is busy: an action's `runner.timeline()` span
    (from the end of its receives to the end of posting its isends) plus the executor's work
    since the previous action (posting receives ahead, bookkeeping), which is what a
    simulator's action cost has to cover. idle = 1 - busy / T, with T from the earliest
    action start to the latest action end over all ranks; the result is the median step's
    idle (mean over ranks), as for every timing here. The simulator gets each stage's
    median F and B busy time, and as `comm_cost` either nothing, `ping_ms` (a separately
    measured transfer of one boundary tensor) or the median transfer latency seen in these
    steps."""
    waits = ReceiveWaits(runner.communicator)
    runner.record_timeline = True
    # On rank 0: per timed step, every rank's [(action, start, end, busy, wait before it,
    # end of that wait)].
    per_step = []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        waits.spans.clear()
        dist.barrier()
        runner.step(*runner.local_batch(x, y))
        optimizer.step()
        optimizer.zero_grad()
        rows, previous_end = [], None
        for a, s, e in runner.timeline():
            since = s if previous_end is None else previous_end
            before = [(ws, we) for ws, we in waits.spans if ws >= since and we <= s]
            waited = sum(we - ws for ws, we in before)
            rows.append((a, s, e, e - since - waited, waited,
                         max((we for _, we in before), default=None)))
            previous_end = e
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        if i >= warmup:
            per_step.append(gathered)
    runner.record_timeline = False
    del runner.communicator.exchange  # back to the class's method
    if dist.get_rank() != 0:
        return {}
    schedule, stages = program.schedule, len(program.stages)
    costs: dict[tuple[int, str], list[float]] = {(s, k): [] for s in range(stages) for k in "FBW"}
    step_times, idle, wait_share, replay_bubbles, replay_times, hops = [], [], [], [], [], []
    for ranks in per_step:
        begin = min(s for rows in ranks for _, s, *_ in rows)
        T = max(e for rows in ranks for _, _, e, *_ in rows) - begin
        step_times.append(T)
        durations, ends = {}, {}
        for rows in ranks:
            busy = sum(row[3] for row in rows)
            idle.append(1 - busy / T)
            wait_share.append(sum(row[4] for row in rows) / T)
            for text, _, e, action_busy, *_ in rows:
                action = Action.parse(text)
                durations[action], ends[action] = action_busy, e
                costs[(action.stage, action.kind)].append(action_busy)
        # Transfer latency: from the producer's end (its isend posted) to the end of the
        # consumer's wait, for waits longer than 50 us on a cross-rank input.
        for rows in ranks:
            for text, _, _, _, waited, received in rows:
                action = Action.parse(text)
                if received is None or waited < 50e-6 or action.kind == "W":
                    continue
                if action.kind == "F":
                    producer = Action(action.stage - 1, "F", action.microbatch)
                else:
                    producer = Action(action.stage + 1, "B", action.microbatch)
                if producer in ends:
                    hops.append(received - ends[producer])
        # The step replayed through the simulator's rules with each action's own duration.
        replayed = simulate(schedule, 0, 0, action_cost=durations)
        replay_times.append(float(replayed.total))
        replay_bubbles.append(float(replayed.bubble_fraction))
    med, mean = statistics.median, statistics.fmean
    f, b, w = ([med(costs[(s, k)]) if costs[(s, k)] else 0.0 for s in range(stages)] for k in "FBW")
    hop = med(hops) if hops else 0.0
    simulated = {
        "none": simulate(schedule, f, b, weight_cost=w),
        "ping": simulate(schedule, f, b, weight_cost=w, comm_cost=ping_ms / 1e3),
        "observed": simulate(schedule, f, b, weight_cost=w, comm_cost=hop),
    }
    example = per_step[len(per_step) // 2]
    origin = min(s for rows in example for _, s, *_ in rows)
    return {
        "steps": len(per_step),
        "step_ms": 1e3 * med(step_times),
        # Per step: the mean over ranks; the headline is the median step, as every timing here.
        "idle_per_step": (per_step_idle := [mean(idle[i:i + schedule.p])
                                            for i in range(0, len(idle), schedule.p)]),
        "idle": med(per_step_idle),
        "idle_mean": mean(idle),
        "receive_wait_share": mean(wait_share),
        "forward_ms": [1e3 * v for v in f],
        "backward_ms": [1e3 * v for v in b],
        "weight_ms": [1e3 * v for v in w],
        "ping_ms": ping_ms,
        "hop_ms": 1e3 * hop,
        "hops": len(hops),
        **{f"simulated_bubble_{k}": float(v.bubble_fraction) for k, v in simulated.items()},
        **{f"simulated_step_ms_{k}": 1e3 * float(v.total) for k, v in simulated.items()},
        "replay_bubble": med(replay_bubbles),
        "replay_bubble_per_step": replay_bubbles,
        "step_ms_per_step": [1e3 * t for t in step_times],
        "replay_step_ms_per_step": [1e3 * t for t in replay_times],
        "replay_step_ms": 1e3 * med(replay_times),
        "unit_cost_bubble": float(
            simulate(schedule, 1, 1, weight_cost=int(schedule.splits_backward)).bubble_fraction
        ),
        "example_timeline_ms": [
            [(a, round(1e3 * (s - origin), 3), round(1e3 * (e - origin), 3), round(1e3 * w, 3))
             for a, s, e, _, w, _ in rows]
            for rows in example
        ],
    }


def torch_bubble(side: TorchPipeline, batches, steps: int, warmup: int) -> dict:
    """The same compute-only idle fraction for torch: spans of forward/backward_one_chunk."""
    side.record()
    per_step = []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        dist.barrier()
        side.step(x, y)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(side.spans))
        if i >= warmup:
            per_step.append(gathered)
    side.spans = None
    if dist.get_rank() != 0:
        return {}
    idle, step_times = [], []
    for ranks in per_step:
        begin = min(s for rows in ranks for _, s, _ in rows)
        end = max(e for rows in ranks for _, _, e in rows)
        step_times.append(end - begin)
        for rows in ranks:
            idle.append(1 - sum(e - s for _, s, e in rows) / (end - begin))
    return {"step_ms": 1e3 * statistics.median(step_times), "idle_compute": statistics.fmean(idle)}


def p2p_latency(shape: tuple[int, ...], compute_ms: float, count: int = 40) -> dict[str, float]:
    """Median ms from rank 0's isend of one boundary-sized tensor to the end of rank 1's
    (already waiting) recv: with rank 0 idle after the isend, and with rank 0 computing
    (matmuls) for `compute_ms` right after it, as a pipeline rank does with its next action."""
    tensor = torch.randn(shape)
    weight = torch.randn(shape[-1], 4 * shape[-1])
    rows = tensor.reshape(-1, shape[-1])
    result = {}
    for mode in ("sender idle", "sender computes"):
        latencies = []
        for i in range(count):
            dist.barrier()
            if dist.get_rank() == 0:
                time.sleep(0.002)  # rank 1 is waiting in recv by now
                mark = time.perf_counter()
                work = dist.isend(tensor, dst=1, tag=1_000_000 + i)
                until = mark + compute_ms / 1e3
                while mode == "sender computes" and time.perf_counter() < until:
                    rows @ weight
                work.wait()
            else:
                buffer = torch.empty(shape)
                dist.recv(buffer, src=0, tag=1_000_000 + i)
                mark = time.perf_counter()
            marks: list = [None] * dist.get_world_size()
            dist.all_gather_object(marks, mark)
            latencies.append(marks[1] - marks[0])
        result[mode] = 1e3 * statistics.median(latencies)
    return result
