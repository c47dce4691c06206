"""Clipping gradients by their global norm, as `torch.nn.utils.clip_grad_norm_` does on one device.

One device's norm runs over every element of every parameter's gradient, once. A rank holds
its gradients in pieces and in copies:

    pieces   a tensor-parallel shard, ZeRO-3's flat piece, ZeRO-1/2's shard of a flat
             bucket, the parameters of this rank's pipeline stages
    copies   a gradient replicated over dp (plain data parallelism) or over tp (a layer norm's
             weight), a tied weight held by two pipeline stages

Each rank adds up |g|^p over the elements it is the counted holder of: every piece, and of a
copy the first (dp index 0, tp index 0; of a tied weight the first stage holding it, the one
that writes it to a checkpoint, `RankState.writer_stage`). One all-reduce over the world sums
those (the maximum for the inf-norm), the p-th root is the norm, and every rank multiplies
the gradients its optimizer reads (ZeRO-1/2's reduced shards, else the parameters' `.grad`,
copies included) by torch's coefficient, max_norm / (norm + 1e-6) capped at 1 (a non-finite
norm scales them by NaN, as torch's default does). The sums run in fp32 (torch sums in the
gradients' dtype: a bf16-mixed rank's norm is the more exact).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fxpar.ir import meta
from fxpar.ir.placement import Replicate, Shard
from fxpar.runtime.checkpoint.state import RankState
from fxpar.runtime.checkpoint.whole_state import graph_parameters
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import world_group


def clip_grad_norm_(state: RankState, communicator: Communicator, max_norm: float, norm_type: float = 2.0, *,
                    sharded: bool) -> torch.Tensor:
    """Scale this rank's gradients so that the whole model's have norm at most `max_norm`, and
    return that norm before scaling (module doc); `sharded`: the optimizer reads ZeRO-1/2's
    reduced bucket shards. Every rank must call it."""
    norm_type = float(norm_type)
    counted, scaled = _sharded_gradients(state) if sharded else _parameter_gradients(state)
    infinite = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=state.device)
    for gradient in counted:
        magnitude = gradient.detach().float().abs()
        total = torch.maximum(total, magnitude.max()) if infinite else total + magnitude.pow(norm_type).sum()
    if dist.get_world_size() > 1:
        communicator.all_reduce_now(total, world_group(state.rank), tag="gradient norm",
                                    op="max" if infinite else "sum", phase="step", log=False)
    norm = total if infinite else total.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for gradient in scaled:
        gradient.mul_(coefficient.to(gradient.dtype))
    return norm


def _parameter_gradients(state: RankState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the `.grad`s this rank counts, every `.grad` it holds)."""
    writers = state.writer_stage()
    counted, held = [], []
    for module in state.modules:
        trained = meta.trained_parameters(module)
        for name, parameter in graph_parameters(module).items():
            if name not in trained or parameter.grad is None:
                continue
            held.append(parameter.grad)
            if _first_copy(state, module, name, ("dp", "cp", "tp"), writers):
                counted.append(parameter.grad)
    return counted, held


def _sharded_gradients(state: RankState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """ZeRO-1/2: (the parts of this rank's reduced shards it counts, the shards). A shard is
    this dp rank's alone; the parameters it crosses may still be copies over tp or pipeline
    stages, counted once as above. An expert's gradient under ep, in no bucket, is whole."""
    writers = state.writer_stage()
    counted, held = [], []
    for module, buckets in zip(state.modules, state.buckets):
        for index in range(len(buckets.states)):
            shard = buckets.shard_gradient(index)
            if shard is None:  # no gradient since zero_grad
                continue
            held.append(shard)
            for name, _, _, start, stop in buckets.shard_spans(index):
                if _first_copy(state, module, name, ("cp", "tp"), writers):
                    counted.append(shard[start:stop])
        for name in meta.unbucketed_parameters(module.graph):  # an expert's, whole
            grad = module.get_parameter(name).grad
            if grad is not None:
                held.append(grad)
                if _first_copy(state, module, name, ("dp", "cp", "tp"), writers):
                    counted.append(grad)
    return counted, held


def _first_copy(state: RankState, module, name: str, axes: tuple[str, ...], writers: dict[str, int]) -> bool:
    """Whether this rank's gradient of `name` is the one counted: index 0 on each of `axes` the
    parameter is replicated on, and the first stage holding it (`RankState.writer_stage`)."""
    placements, coord, stage = state.placements(module, name), state.coord, meta.stage_of(module)
    replica = any(_replica(placements, coord, axis) for axis in axes)
    return not replica and writers.get(name, stage) == stage


def _replica(placements, coord, axis: str) -> bool:
    """Whether the rank at `coord` holds a second copy of a value along `axis`. An expert's
    weights (Shard on ep) are copies over dp only among the ranks holding the same experts."""
    if axis == "dp" and isinstance(placements.ep, Shard):
        return coord["edp"] != 0
    return isinstance(placements[axis], Replicate) and coord[axis] != 0

