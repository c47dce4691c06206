"""Tensor-parallel rank modules run as threads of this process (tier 1 of the tp tests).

The rank modules' collectives meet in `ThreadedCollectives` (no process group, no torchrun);
`assert_equals_one_device` holds their loss and every gradient, reassembled from the shards,
to one device's: fp32, relative 1e-4 and absolute 1e-6, since sharding sums the same
products in another order, nothing more. `captured` and `compiled` give the Hugging Face
models of tests/hf_models.py, one torch.export each.
"""

import dataclasses
import functools
import sys
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

import fxpar
from fxpar.frontend.trace import capture
from fxpar.ir import meta
from fxpar.ir.axes import bind_axes, unbind_axes
from fxpar.ir.placement import global_tensor

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_models import build  # noqa: E402

LAYERS = 2  # of every model in tests/hf_models.py


# -- rank modules as threads -------------------------------------------------------------------


class ThreadedCollectives:
    """Mesh axis "tp" for tp ranks that are threads of one process (`fxpar.ir.axes.AxisBinding`):
    each collective is a meeting at a barrier where every rank posts its tensor and reads all
    the others'. A thread's rank is its index on the axis."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.posted: list[torch.Tensor | None] = [None] * size
        self.log: list[list[tuple[str, str]]] = [[] for _ in range(size)]
        self._thread = threading.local()

    @property
    def index(self) -> int:
        return self._thread.rank

    def run_as(self, rank: int, work):
        self._thread.rank = rank
        return work()

    def _meet(self, tensor, kind: str, phase: str) -> list[torch.Tensor]:
        self.log[self.index].append((kind, phase))
        self.posted[self.index] = tensor.detach().clone()
        self.barrier.wait()
        pieces = list(self.posted)
        self.barrier.wait()  # nobody posts the next tensor before all have read this one
        return pieces

    def all_reduce(self, tensor, *, op, tag, phase):
        pieces = torch.stack(self._meet(tensor, "all_reduce", phase))
        tensor.copy_(pieces.amax(0) if op == "max" else pieces.sum(0))

    def all_gather(self, output, tensor, *, tag, phase):
        output.copy_(torch.cat(self._meet(tensor, "all_gather", phase)))

    def reduce_scatter(self, output, tensor, *, tag, phase):
        total = torch.stack(self._meet(tensor, "reduce_scatter", phase)).sum(0)
        output.copy_(total.chunk(self.size)[self.index])



def layer_collectives(program: fxpar.Program) -> list:
    """Rank 0's collectives of the model's own ops: what the layers and the loss move, without
    the step agreement (`lowering.step_start_actions`), its own call or the slots it rides in
    (`lowering.ride_agreements`)."""
    return [dataclasses.replace(c, numel=c.numel - c.agreement, agreement=0)  # slots riding in a call
            for c in program.collectives(0) if not c.tag.startswith("step agreement")]


def run_ranks_in_threads(program: fxpar.Program, inputs: tuple) -> tuple[list, ThreadedCollectives]:
    """Each tp rank's (loss, {parameter name: gradient}) for one step on `inputs`."""
    if program.loss_reduction.sums:  # the step's count of valid targets, as the runner passes it
        inputs = (*inputs, program.loss_reduction.count_module(*inputs).float())
    collectives = ThreadedCollectives(program.mesh.tp)
    results, errors = [None] * program.mesh.tp, []

    def rank(r: int) -> None:
        try:
            module = program.rank_module(r)
            names, parameters = zip(*module.named_parameters())
            loss = module(*inputs)
            # autograd.grad, not backward: replicated parameters are shared by the rank modules
            gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
            results[r] = (loss.detach(), dict(zip(names, gradients)))
        except BaseException as error:  # a failing rank releases the others from the barrier
            errors.append(error)
            collectives.barrier.abort()

    threads = [threading.Thread(target=collectives.run_as, args=(r, lambda r=r: rank(r)))
               for r in range(program.mesh.tp)]
    bind_axes({"tp": collectives})
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        unbind_axes()
    if errors:
        raise errors[0]
    return results, collectives


def assert_equals_one_device(program: fxpar.Program, model: nn.Module, inputs: tuple) -> dict:
    """Loss and every gradient of the tp ranks equal one device's; returns the global grads."""
    results, _ = run_ranks_in_threads(program, inputs)
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    for rank_loss, _ in results:
        torch.testing.assert_close(rank_loss, loss.detach(), rtol=1e-5, atol=1e-6)
    partial = set(meta.partial_gradient_parameters(program.graph_module.graph))
    found = {}
    for name, node in meta.parameter_nodes(program.graph_module.graph).items():
        pieces = [grads[name] for _, grads in results]
        if name in partial:  # the runner sums these over the tp group after backward
            pieces = [sum(pieces)] * len(pieces)
        found[name] = global_tensor(pieces, meta.placement(node, "tp"))
        torch.testing.assert_close(found[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    return found


@functools.cache
def captured(name: str, attention: str = "sdpa") -> tuple[nn.Module, tuple, fxpar.CapturedGraph]:
    """A Hugging Face model, its inputs and its capture: one torch.export for all tests here."""
    model, inputs = build(name, attention)
    return model, inputs, capture(model, inputs)


def compiled(name: str, plan: fxpar.Plan | str, attention: str = "sdpa") -> tuple:
    """(model, inputs, program) of a Hugging Face model compiled for `plan`."""
    model, inputs, graph = captured(name, attention)
    return model, inputs, fxpar.compile(graph, plan)


def kinds(program: fxpar.Program) -> Counter:
    return Counter((c.kind, c.phase) for c in layer_collectives(program))
