"""What one rank holds, counted from its tensors: the model-state terms of the estimate.

    params      bytes of the parameters (under ZeRO-1/2 their flat per-bucket buffers,
                padding included)
    grads       bytes of gradient storage held: the buckets' buffers, ZeRO-2's reduced
                shards, any gradient outside a bucket
    optimizer   bytes of the optimizers' state tensors (Adam's two moments, its step counts)
                and, under bf16-mixed, of the fp32 master weights (`runtime.state.master_weights`)
    activations (added by the runner) bytes held for backward at their peak during the last
                step, measured by `runtime.step.saved_tensors`
    peak        the allocator's peak on a CUDA device since the last reset (None on the CPU)

Each storage is counted once, however many tensors view it (a parameter and its flat
buffer, a gradient and its bucket). ZeRO's memory terms (Rajbhandari et al. 2020, Sec. 5:
with Adam in fp32, 16P without ZeRO, 8P + 8P/N for stage 1, 4P + 12P/N for stage 2) are
these numbers, at the padding of each bucket to a multiple of N (`Bucket.padded`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(modules, buckets, optimizers, device: torch.device, *, masters=()) -> dict[str, int | None]:
    """The terms of the module doc for a rank's stage `modules`, its `GradientBuckets`, the
    optimizers it made and bf16-mixed's fp32 `masters` (counted as optimizer state)."""
    seen: set[int] = set()
    parameters = [p for m in modules for p in m.parameters()]
    params = _bytes(parameters, seen)
    held = [s.buffer for b in buckets for s in b.states] + [s.reduced for b in buckets for s in b.states]
    grads = _bytes([*held, *(p.grad for p in parameters)], seen)
    state = [t for opt in optimizers for per_tensor in opt.state.values() for t in per_tensor.values()
             if isinstance(t, torch.Tensor)]
    optimizer = _bytes([*state, *masters], seen)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"params": params, "grads": grads, "optimizer": optimizer, "peak": peak}
