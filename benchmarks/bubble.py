"""The measured pipeline bubble: timelines, transfer waits, and the simulator's rules replayed.

Used by `bench_pipeline.py` (its docstring, part 2, says what each number means).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fxpar.schedules import Action, Schedule, simulate

if TYPE_CHECKING:
    from bench_pipeline import TorchPipeline


class CommSpans:
    """Wraps this runner's `communicator.recv_all` / `.send_all` to time each receive wait and
    send post.

    Instance attributes shadow the methods on this one benchmark's communicator only."""

    def __init__(self, communicator):
        self.recvs: list[tuple[float, float]] = []
        self.sends: list[tuple[float, float]] = []
        recv, send = communicator.recv_all, communicator.send_all

        def timed_recv(*args, **kwargs):
            start = time.perf_counter()
            try:
                return recv(*args, **kwargs)
            finally:
                self.recvs.append((start, time.perf_counter()))

        def timed_send(*args, **kwargs):
            start = time.perf_counter()
            try:
                return send(*args, **kwargs)
            finally:
                self.sends.append((start, time.perf_counter()))

        communicator.recv_all, communicator.send_all = timed_recv, timed_send

    def clear(self) -> None:
        self.recvs.clear()
        self.sends.clear()


def inside(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Total length of the spans that lie within [start, end]."""
    return sum(e - s for s, e in spans if s >= start and e <= end)


def sum_over_ranks(values: tuple[float, ...]) -> tuple[float, ...]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tuple(tensor.tolist())


def replay(schedule: Schedule, durations: dict[Action, float]) -> float:
    """The makespan of `schedule` with each action's own duration and no communication time.

    `simulate` with one cost per action instead of one per stage: the same rules (F(s, mb) after
    F(s-1, mb); B(s, mb) after F(s, mb) and B(s+1, mb); each rank in its order)."""
    end: dict[Action, float] = {}
    clock = [0.0] * schedule.p
    done = [0] * schedule.p
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(schedule.actions):
            while done[rank] < len(row):
                a = row[done[rank]]
                if a.kind == "F":
                    deps = [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
                else:
                    deps = [Action(a.stage, "F", a.microbatch)]
                    if a.stage < schedule.stages - 1:
                        deps.append(Action(a.stage + 1, "B", a.microbatch))
                if any(d not in end for d in deps):
                    break
                start = max([clock[rank], *(end[d] for d in deps)])
                clock[rank] = end[a] = start + durations[a]
                done[rank] += 1
                progress = True
    return max(clock)


def fxpar_bubble(runner, optimizer, program, batches, steps: int, warmup: int) -> dict:
    """Run `warmup + steps` fxpar steps recording timelines; the measured and simulated bubble.

    Per action of `runner.timeline()`: span = end - start; recv = time blocked in receives
    inside it; send = time posting isends inside it; compute = span - recv - send (the stage's
    forward or backward and the executor's bookkeeping)."""
    comm = CommSpans(runner.communicator)
    runner.record_timeline = True
    # On rank 0: per timed step, both ranks' [(action, start, end, recv, send, last recv end)].
    per_step = []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        comm.clear()
        dist.barrier()
        runner.step(*runner.local_batch(x, y))
        optimizer.step()
        optimizer.zero_grad()
        rows = [(a, s, e, inside(comm.recvs, s, e), inside(comm.sends, s, e),
                 max((re for rs, re in comm.recvs if rs >= s and re <= e), default=None))
                for a, s, e in runner.timeline()]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        if i >= warmup:
            per_step.append(gathered)
    runner.record_timeline = False
    if dist.get_rank() != 0:
        return {}
    schedule, stages = program.schedule, len(program.stages)
    compute: dict[tuple[int, str], list[float]] = {(s, k): [] for s in range(stages) for k in "FB"}
    raw: dict[tuple[int, str], list[float]] = {(s, k): [] for s in range(stages) for k in "FB"}
    shares: dict[str, list[float]] = {k: [] for k in
                                      ("idle_timeline", "idle_compute", "recv", "send")}
    step_times, replay_bubbles, replay_times, step_idle, hops = [], [], [], [], []
    for ranks in per_step:
        begin = min(s for rows in ranks for _, s, *_ in rows)
        T = max(e for rows in ranks for _, _, e, *_ in rows) - begin
        step_times.append(T)
        durations, compute_end, idle_this_step, busy_total = {}, {}, [], 0.0
        for rows in ranks:
            spans = sum(e - s for _, s, e, *_ in rows)
            recv = sum(row[3] for row in rows)
            send = sum(row[4] for row in rows)
            busy = spans - recv - send
            busy_total += busy
            shares["idle_timeline"].append(1 - spans / T)
            shares["idle_compute"].append(1 - busy / T)
            shares["recv"].append(recv / T)
            shares["send"].append(send / T)
            idle_this_step.append(1 - busy / T)
            for text, s, e, r, sd, _ in rows:
                action = Action.parse(text)
                compute_end[action] = e - sd
                durations[action] = e - s - r - sd
                compute[(action.stage, action.kind)].append(e - s - r - sd)
                raw[(action.stage, action.kind)].append(e - s)
        step_idle.append(statistics.fmean(idle_this_step))
        # Transfer latency: from the producer's compute end (before its isend) to the end of
        # the consumer's receive, for receives that waited (> 50 us) on a cross-rank input.
        for rows in ranks:
            for text, s, e, r, sd, received in rows:
                action = Action.parse(text)
                if received is None or r < 50e-6:
                    continue
                if action.kind == "F":
                    producer = Action(action.stage - 1, "F", action.microbatch)
                else:
                    producer = Action(action.stage + 1, "B", action.microbatch)
                if producer in compute_end:
                    hops.append(received - compute_end[producer])
        makespan = replay(schedule, durations)
        replay_times.append(makespan)
        replay_bubbles.append(1 - busy_total / (schedule.p * makespan))
    med = statistics.median
    f = [med(compute[(s, "F")]) for s in range(stages)]
    b = [med(compute[(s, "B")]) for s in range(stages)]
    f_raw = [med(raw[(s, "F")]) for s in range(stages)]
    b_raw = [med(raw[(s, "B")]) for s in range(stages)]
    simulated = simulate(schedule, f, b)
    simulated_raw = simulate(schedule, f_raw, b_raw)
    hop = med(hops) if hops else 0.0
    simulated_comm = simulate(schedule, f, b, comm_cost=hop)
    example = per_step[len(per_step) // 2]
    origin = min(s for rows in example for _, s, *_ in rows)
    mean = statistics.fmean
    return {
        "steps": len(per_step),
        "step_ms": 1e3 * med(step_times),
        "idle_timeline": mean(shares["idle_timeline"]),
        "idle_compute": mean(shares["idle_compute"]),
        "idle_compute_per_step": step_idle,
        "recv_wait_share": mean(shares["recv"]),
        "send_post_share": mean(shares["send"]),
        "forward_ms": [1e3 * v for v in f],
        "backward_ms": [1e3 * v for v in b],
        "forward_raw_ms": [1e3 * v for v in f_raw],
        "backward_raw_ms": [1e3 * v for v in b_raw],
        "simulated_bubble": float(simulated.bubble_fraction),
        "simulated_step_ms": 1e3 * float(simulated.total),
        "simulated_bubble_raw": float(simulated_raw.bubble_fraction),
        "hop_ms": 1e3 * hop,
        "hops": len(hops),
        "simulated_bubble_comm": float(simulated_comm.bubble_fraction),
        "simulated_comm_step_ms": 1e3 * float(simulated_comm.total),
        "replay_bubble": mean(replay_bubbles),
        "replay_step_ms": 1e3 * med(replay_times),
        "ideal_bubble": (schedule.p - 1) / (schedule.m + schedule.p - 1),
        "example_timeline_ms": [
            [(a, round(1e3 * (s - origin), 3), round(1e3 * (e - origin), 3), round(1e3 * r, 3),
              round(1e3 * sd, 3))
             for a, s, e, r, sd, _ in rows]
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
