"""The pipeline executor: one rank runs its step program's actions on its stage modules.

The step program (`fxpar.compiler.lowering`) holds the schedule's row for this rank, with an Exchange
before each compute action. For each compute action, in order:

    F(s, mb)  receive stage s's inputs from stage s-1's rank (shapes known at compile time:
              buffers are allocated from the step program's receive calls, no shape
              exchange), run the
              stage module, send its outputs to stage s+1's rank; the last stage keeps the
              loss (its share of the step's: `runtime.step.loss`).
    B(s, mb)  receive the gradients of stage s's outputs, run backward through the stage,
              send the gradients of its inputs back. Under a zero-bubble schedule the linear
              layers' weight gradients are left for W (`runtime.step.weight_gradients`).
    W(s, mb)  compute those weight gradients (zero-bubble schedules only).

The executor reads the bound rank through its `StepContext` (modules, buckets, loss,
communicator, groups, settings) and the compiled program (schedule, stages, mesh), nothing
else. Under a zero-bubble schedule its F actions pass its `WeightGradientStore` to the stage
module as the module's last input (`passes.weight_gradients`), and its B actions collect into
that store: the deferral is data flow, with no state outside the executor.

Each Exchange between two compute actions starts one batch of transfers (`torch.distributed.
batch_isend_irecv`, one NCCL group): the sends of the action that just ran and the receives it
lists, which the rank waits for when their action runs. On gloo those are the receives one
action ahead; on NCCL the next action's own (`pipeline_program.receives_ahead` says why,
`issue_order` is the order lowering writes). Sends are waited for at the end of the step. A
rank only ever blocks on the receives of the action it runs next, so it never waits on a peer
that waits on it, for any schedule the simulator accepts. Each tensor has its own tag per
stage, microbatch, direction and index. The Communicate actions at the end (buckets, partial
and tied gradients, the loss over the pipeline and dp) run in `runtime.step.actions`.

Why fxpar's own executor and not `torch.distributed.pipelining`'s: fxpar already has stage
GraphModules with boundary shapes known symbolically, tensor-parallel collectives inside the
stages, and its own gradient buckets and loss reduction; torch's runtime wants
`PipelineStage` objects with their own shape inference and its own loss and gradient
handling, which would duplicate or fight all three. The benchmark
(`benchmarks/bench_pipeline.py`) compares the two on the same stages.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sympy
import torch

from fxpar.ir.step_program import Call, Communicate, Exchange, Receive
from fxpar.passes.weight_gradients import takes_weight_gradients
from fxpar.runtime.communicator import Transfer
from fxpar.runtime.step.actions import StepState, communicate
from fxpar.runtime.step.weight_gradients import WeightGradientStore

if TYPE_CHECKING:
    from fxpar.ir.compiled_program import CompiledProgram
    from fxpar.runtime.communicator import PendingCollective
    from fxpar.runtime.step.context import StepContext


class PipelineExecutor:
    def __init__(self, context: StepContext, program: CompiledProgram):
        self.context = context
        self.program = program
        self.schedule = program.schedule
        coord = program.mesh.coord(context.rank)
        self.coord = coord
        self.timeline: list[tuple[str, float, float]] = []
        self.weights = WeightGradientStore()  # B's deferred weight gradients, until their W
        # What each F passes its module after the inputs: the store, to a module that defers.
        self._store_input = [
            (self.weights,) if takes_weight_gradients(m) else () for m in context.modules
        ]
        self._shapes: dict[tuple, tuple[int, ...]] = {}

    def _peer(self, stage: int) -> int:
        return self.program.mesh.rank_of(dp=self.coord.dp, pp=self.schedule.rank_of(stage), tp=self.coord.tp,
                                         cp=self.coord.cp)

    def _module(self, stage: int):
        return self.context.forwards[stage // self.schedule.p]

    def _key(self, stage: int, microbatch: int, backward: bool) -> int:
        """The wire tag of what `stage` receives for `microbatch`, forward or backward."""
        return (stage * self.schedule.m + microbatch) * 2 + int(backward)

    def _receive(self, receive: Receive, action, sizes: dict, size_key: tuple) -> Transfer:
        """Fresh buffers for what `action` receives, one per call of `receive`, each of the
        call's local shape at this step's sizes (cached: sympy is slow per call)."""
        buffers = []
        for call in receive.calls:
            if (id(call), size_key) not in self._shapes:
                self._shapes[id(call), size_key] = tuple(int(sympy.sympify(d).subs(sizes)) for d in call.shape)
            buffers.append(torch.empty(self._shapes[id(call), size_key], dtype=call.dtype, device=self.context.device))
        first = receive.calls[0]
        return Transfer("recv", buffers, self._peer(first.peer_stage), first.tag, first.phase,
                        self._key(action.stage, action.microbatch, action.kind == "B"))

    def _sends(self, calls: tuple[Call, ...], produced: tuple) -> list[Transfer]:
        """What the action that just ran produced for its neighbour stage, sent as the
        transfer `calls` lowering wrote for it. `produced`: (the action, its tensors) or ()."""
        if not calls:
            return []
        action, tensors = produced
        assert len(calls) == len(tensors), f"{action} produced {len(tensors)} tensors for {len(calls)} sends"
        first = calls[0]
        return [Transfer("send", tensors, self._peer(first.peer_stage), first.tag, first.phase,
                         self._key(first.peer_stage, action.microbatch, action.kind == "B"))]

    def run(self, chunks: list[tuple[torch.Tensor, ...]], sizes: dict) -> float:
        """One training step over this rank's microbatches (export's size symbols at `sizes`,
        which boundary shapes are formulas in); returns the global-batch mean loss."""
        context = self.context
        size_key = tuple(sorted((str(k), int(v)) for k, v in sizes.items()))
        state = StepState(chunks, torch.zeros((), device=context.device), context.loss.local_count(chunks))
        step = _Step(state)
        receiving: dict[int, tuple[list[torch.Tensor], list[PendingCollective]]] = {}
        produced: tuple = ()  # (the compute action that just ran, the tensors it sends on)
        computes = context.step_program.computes()  # this rank's schedule row
        position = -1  # of the compute action running
        for buckets in context.buckets:
            buckets.start_step(len(chunks), state.count)
        for gatherer in context.gatherers:
            gatherer.start_step(len(chunks))
        self.timeline = []
        for action in context.step_program.actions:
            if isinstance(action, Exchange):
                self._post(action, self._sends(action.sends, produced), receiving, step, computes, sizes, size_key)
                produced = ()
            elif isinstance(action, Communicate):
                if step.sends and position == len(computes) - 1:  # the compute is over: its last sends land first
                    for send in step.sends:
                        send.wait()
                    step.sends = []
                communicate(action, context, state)
            else:
                position += 1
                received, transfers = receiving.pop(position, ([], []))
                for transfer in transfers:
                    transfer.wait()
                start = time.perf_counter()  # the timeline shows compute, not waiting for peers
                with context.random.at(action.microbatch):  # a recompute draws as its forward did
                    if action.kind == "F":
                        produced = (action, self._forward(action, received, step))
                    elif action.kind == "B":
                        produced = (action, self._backward(action, received, step))
                    else:
                        self.weights.run((action.stage, action.microbatch))
                    if action.kind != "F":
                        context.land_gradients()
                if context.record_timeline:
                    self.timeline.append((str(action), start, time.perf_counter()))
        for send in step.sends:
            send.wait()
        return state.result()

    def _post(self, exchange: Exchange, sends: list[Transfer], receiving: dict, step: _Step,
              computes: list, sizes: dict, size_key: tuple) -> None:
        """Start `sends` and the receives `exchange` lists as one batch."""
        receives = {r.action: self._receive(r, computes[r.action], sizes, size_key) for r in exchange.receives}
        pending = self.context.communicator.exchange(self.context.rank, [*sends, *receives.values()])
        for waits in pending[:len(sends)]:
            step.sends += waits
        for (index, transfer), waits in zip(receives.items(), pending[len(sends):]):
            receiving[index] = (transfer.tensors, waits)

    def _forward(self, action, received: list[torch.Tensor], step: _Step) -> list[torch.Tensor]:
        """F: run the stage on its received inputs; returns its outputs for the next stage
        (the last stage keeps its loss, its share of the step's: `runtime.step.loss`)."""
        stage, mb = self.program.stages[action.stage], action.microbatch
        for boundary, buffer in zip(stage.inputs, received):
            buffer.requires_grad_(boundary.requires_grad)
        user = dict(zip(self.program.input_names, step.state.inputs(self.context, mb)))
        store = self._store_input[stage.index // self.schedule.p]  # (), or (its store,)
        with self.context.saving(self.context.module_of_stage[stage.index]):
            result = self._module(stage.index)(*received, *(user[n] for n in stage.user_inputs), *store)
        step.inputs[(stage.index, mb)] = received
        if stage.index == len(self.program.stages) - 1:
            loss = self.context.loss.share(result, len(step.state.chunks))
            step.state.loss += loss.detach()
            step.outputs[(stage.index, mb)] = (loss,)
            return []
        step.outputs[(stage.index, mb)] = result
        return [v.detach() for v in result]

    def _backward(self, action, received: list[torch.Tensor], step: _Step) -> list[torch.Tensor]:
        """B: backward through the stage from its outputs' received gradients (the last stage:
        from its loss); returns its inputs' gradients for the previous stage. Under a zero-bubble
        schedule the linear weights' gradients are left for the W action."""
        stage, mb = self.program.stages[action.stage], action.microbatch
        self.context.count_arrival.settle()  # the steps agreed before gradients move
        produced = step.outputs.pop((stage.index, mb))
        if stage.index == len(self.program.stages) - 1:
            tensors, grads = [produced[0]], None
        else:
            tensors, grads = [v for b, v in zip(stage.outputs, produced) if b.requires_grad], received
        with self.weights.collect((stage.index, mb)) if self.schedule.splits_backward else nullcontext():
            torch.autograd.backward(tensors, grads)
        stage_inputs = step.inputs.pop((stage.index, mb))
        if stage.index == 0:
            return []
        return [
            value.grad if value.grad is not None else torch.zeros_like(value)
            for boundary, value in zip(stage.inputs, stage_inputs) if boundary.requires_grad
        ]


@dataclass
class _Step:
    """What one step's actions hand each other: the shared `StepState` (microbatches, loss),
    inputs kept for backward, outputs (or the loss) until their B, and the isends to wait for."""

    state: StepState
    inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    sends: list[PendingCollective] = field(default_factory=list)
