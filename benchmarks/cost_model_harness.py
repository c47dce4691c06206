"""Measurements that `bench_cost_model.py` sets against `program.estimate()`, one per term.

Map: `model_state_bytes` (params, grads, optimizer state actually held), `saved_activations`
(bytes autograd saves in a real forward), `allocation_peak` (peak CPU bytes allocated inside
a region, from the profiler's allocation events), `cuda_peak`, `timed_steps` (per-phase step
times), `isolated_collectives` (the step's collectives alone, without compute),
`per_op_seconds` (a prototype measured compute model: every op timed alone). The ranks'
timings are combined by `harness.reduce_over_ranks`, on the group's device (NCCL or gloo).

Each measurement reads the real objects, never the cost model, so a term it agrees with is
agreement, not the same code run twice:

* model state: the sum of `nbytes` of every distinct parameter, `.grad` and optimizer-state
  tensor, right after `optimizer.step()` (gradients are still there, the state exists);
* activations: the same quantity the cost model derives symbolically (bytes of the distinct
  storages autograd packs for backward, parameters left out), here from the real forward
  through `torch.autograd.graph.saved_tensors_hooks`;
* peak memory: an independent check. On the CPU, `torch.profiler` with
  `profile_memory=True` reports every allocation and free made while it runs (c10's
  `ProfiledCPUMemoryReporter`); their running sum is the net memory the region allocated,
  its maximum the region's peak above what was held when it started. The bytes held at the
  start (model state, the gradient buckets, the input batch) are counted from the tensors
  themselves. On a CUDA device, the caching allocator's own `max_memory_allocated`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from harness import distinct_storage_bytes, reduce_over_ranks


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def model_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held now (call after `step()`).

    `optimizer_moments` leaves out Adam's per-tensor `step` counters, which `optimizer` counts:
    the split shows which part of a difference they make.
    """
    params = list(module.parameters())  # each tied parameter once
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        (name, value)
        for per_param in optimizer.state.values()
        for name, value in per_param.items()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "params": sum(p.nbytes for p in params),
        "grads": sum(g.nbytes for g in grads),
        "grads_storage": distinct_storage_bytes(grads),  # the bucket buffers under dp > 1
        "optimizer": sum(v.nbytes for _, v in state),
        "optimizer_moments": sum(v.nbytes for name, v in state if name != "step"),
        "optimizer_tensors": len(state),
        "parameter_tensors": len(params),
    }


def saved_activations(run: Callable[[], object], exclude: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes of the distinct storages autograd saves while `run()` executes, minus `exclude`'s.

    `run` may include the backward: backward packs nothing (no double backward), and the
    saved tensors are only referenced here until the count is taken.
    """
    excluded = {_storage_key(t) for t in exclude}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    storages: dict[int, int] = {}
    for tensor in saved:
        key = _storage_key(tensor)
        if key in excluded or not tensor.untyped_storage().nbytes():
            continue
        storages[key] = tensor.untyped_storage().nbytes()
    packed = len(saved)
    saved.clear()
    return {"bytes": sum(storages.values()), "storages": len(storages), "packed": packed}


def allocation_peak(run: Callable[[], object]) -> dict[str, int]:
    """Peak and final net bytes allocated on the CPU while `run()` executes (profiler events).

    Each allocation is followed by its address until its free. The profiler records the
    allocations and frees of the threads it profiles (the main thread), so two kinds of event
    are missing: frees of tensors allocated before the region (not counted: the numbers are
    the region's own allocations, the peak above what was held at its start), and frees made
    on another thread, such as gloo's, which drops a collective's buffers when its work
    completes. A block whose address the allocator hands out again was freed by then, so it
    is taken off the count at that point: without this, each collective buffer freed on
    gloo's thread stayed counted to the region's end (up to 3 MiB of a 14 MiB peak, different
    on every rank of one symmetric ZeRO-3 plan).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    blocks = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            blocks.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    blocks.sort(key=lambda b: b[0])
    live: dict[int, int] = {}
    running = peak = 0
    for _, pointer, size in blocks:
        running -= live.pop(pointer, 0)  # a free, or (size > 0) a free on a thread not profiled
        if size > 0:
            live[pointer] = size
            running += size
        peak = max(peak, running)
    return {"peak": peak, "final": running, "events": len(blocks)}


def cuda_peak(run: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated on a CUDA `device` while `run()` executes, all tensors included."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def timed_steps(
    phases: list[Callable[[], object]], *, warmup: int, steps: int, world_size: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Wall and main-thread CPU seconds of each phase of the last `steps` of `warmup + steps`.

    A step runs `phases` in order; a barrier before each step lets every rank start together.
    Wall times are combined over ranks with an all-reduce MAX (a data-parallel step is as slow
    as its slowest rank), CPU times (`time.thread_time`) with a mean, both after the run. CPU
    time leaves out the time the thread waited, for a collective or for a core another
    process held, so on a shared machine it is the quieter measure of the work done.
    """
    wall: list[list[float]] = []
    cpu: list[list[float]] = []
    for i in range(warmup + steps):
        if world_size > 1:
            dist.barrier()
        marks = [(time.perf_counter(), time.thread_time())]
        for phase in phases:
            phase()
            marks.append((time.perf_counter(), time.thread_time()))
        if i >= warmup:
            wall.append([b[0] - a[0] for a, b in zip(marks, marks[1:])])
            cpu.append([b[1] - a[1] for a, b in zip(marks, marks[1:])])
    if world_size > 1:
        wall, cpu = reduce_over_ranks(wall, "max"), reduce_over_ranks(cpu, "mean")
    return wall, cpu


def isolated_collectives(
    payloads: list[tuple[int, torch.dtype]], *, warmup: int, steps: int,
    device: torch.device | str = "cpu",
) -> float:
    """Median seconds to all-reduce buffers of these (numel, dtype) one after another, alone.

    The step's all-reduces without the compute they overlap: what the alpha-beta link model
    predicts before any overlap is applied.
    """
    buffers = [torch.zeros(n, dtype=d, device=device) for n, d in payloads]
    seconds = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for w in works:
            w.wait()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return statistics.median(reduce_over_ranks(seconds, "max"))


class _RecordingInterpreter(fx.Interpreter):
    """Runs a graph and keeps every aten call with its real arguments."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.calls: list[tuple[object, tuple, dict]] = []

    def call_function(self, target, args, kwargs):
        if isinstance(target, torch._ops.OpOverload):
            self.calls.append((target, args, kwargs))
        return super().call_function(target, args, kwargs)


def per_op_seconds(
    gm: fx.GraphModule, inputs: list[torch.Tensor], *, sync: Callable[[], None] = lambda: None,
    repeats: int = 7,
) -> dict[str, float]:
    """Sum over the graph's aten calls of each call's forward + backward time, run alone.

    A prototype of a measured compute model: each distinct (op, argument shapes) is timed once
    (median of `repeats`) on fresh copies of its real arguments, floating ones requiring grad,
    then backward from a random output gradient; the sum weighs each by its occurrences.
    """
    recorder = _RecordingInterpreter(gm)
    with torch.no_grad():
        recorder.run(*inputs)

    def signature(value):
        if isinstance(value, torch.Tensor):
            return ("T", tuple(value.shape), tuple(value.stride()), value.dtype)
        if isinstance(value, (list, tuple)):
            return tuple(signature(v) for v in value)
        return value

    def fresh(value):
        if isinstance(value, torch.Tensor):
            copy = value.detach().clone()
            return copy.requires_grad_(True) if copy.is_floating_point() else copy
        if isinstance(value, (list, tuple)):
            return type(value)(fresh(v) for v in value)
        return value

    timed: dict[tuple, float] = {}
    total = 0.0
    for target, args, kwargs in recorder.calls:
        key = (str(target), signature(args), signature(tuple(sorted(kwargs.items()))))
        if key not in timed:
            args2, kwargs2 = fresh(args), {k: fresh(v) for k, v in kwargs.items()}
            with torch.no_grad():
                probe = target(*args2, **kwargs2)
            grad = (torch.randn_like(probe)
                    if isinstance(probe, torch.Tensor) and probe.is_floating_point() else None)

            def forward_backward():
                out = target(*args2, **kwargs2)
                if grad is not None and isinstance(out, torch.Tensor) and out.grad_fn is not None:
                    out.backward(grad)
                sync()

            forward_backward()
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                forward_backward()
                seconds.append(time.perf_counter() - start)
            timed[key] = statistics.median(seconds)
        total += timed[key]
    return {"seconds": total, "calls": len(recorder.calls), "distinct": len(timed)}
