"""Runner: one rank's side of a compiled Program, inside a torchrun worker.

    runner = program.bind()
    opt = runner.optimizer(torch.optim.AdamW, lr=3e-4)
    for tokens, labels in batches:                      # the global batch, same on all ranks
        loss = runner.step(*runner.local_batch(tokens, labels))
        opt.step(); opt.zero_grad()

`step` splits the local batch into the plan's microbatches and runs forward and backward on
the rank's module (or, with a pipeline, the schedule's actions on its stage modules), lets the
gradient buckets all-reduce during the last backward, and returns the global-batch mean loss,
the same float on every rank. A batch comes in the form of the compile-time example: tensors
in order, or a dict of keyword tensors (`runner.step(runner.local_batch(batch_dict))`).

A runner is live from bind until `close()`, which ends every runner of the process (they share
its process groups); binding a program whose parameters a live runner trains is refused
(`runtime.live_runners` has the rules and why).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fxpar.errors import BindError, PlanError
from fxpar.frontend.batch_rules import batch_rules
from fxpar.ir import meta
from fxpar.ir.axes import bind_axes, unbind_axes
from fxpar.ir.collectives import backend_for
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.mesh import Axis
from fxpar.ops.random_streams import RandomStream, bind_random, unbind_random
from fxpar.runtime import live_runners
from fxpar.runtime.binding import (
    all_tied_groups, bound_device, parameters_of, place_state, step_context, synchronise_copies,
)
from fxpar.runtime.checkpoint.optimizers import record_maker
from fxpar.runtime.checkpoint.whole_state import WholeState
from fxpar.runtime.communicator import AxisOnGroup, Communicator
from fxpar.runtime.environment import TorchrunEnvironment, bind_timeout
from fxpar.runtime.memory_stats import model_state_bytes
from fxpar.runtime.process_groups import RankGroup, init_process_groups
from fxpar.runtime.random_seed import agree_seed, check_seed
from fxpar.runtime.state.gradient_norm import clip_grad_norm_
from fxpar.runtime.state.master_weights import MasterWeights, MixedPrecisionOptimizer
from fxpar.runtime.state.optimizer_defaults import with_defaults
from fxpar.runtime.state.optimizer_reads import require_elementwise_for_pieces
from fxpar.runtime.state.parameter_groups import ParameterGroups, warn_unstepped
from fxpar.runtime.state.sharded_optimizer import ShardedOptimizer
from fxpar.runtime.step.batch_checks import check_batch
from fxpar.runtime.step.context import StepContext
from fxpar.runtime.step.gradient_accumulation import EarlierGradients
from fxpar.runtime.step.guard import StepGuard
from fxpar.runtime.step.loss import StepLoss
from fxpar.runtime.step.module_executor import ModuleExecutor
from fxpar.runtime.step.pipeline_executor import PipelineExecutor
from fxpar.runtime.step.saved_tensors import SavedTensorMeter


class Runner(WholeState):
    def __init__(
        self,
        program: CompiledProgram,
        *,
        rank: int,
        device: torch.device,
        groups: dict[Axis, RankGroup],
        tied_groups: dict[tuple[int, ...], RankGroup],
        communicator: Communicator,
        backend: str,
    ):
        self.program = program
        self.rank = rank
        self.device = device
        self.backend = backend  # "gloo", "nccl", ...
        self.groups = groups
        self.communicator = communicator
        self.modules = program.stage_modules(rank)  # one, or one per pipeline chunk
        self._dp = groups[Axis.DP]
        self._tied_groups = tied_groups
        self._step_program = program.step_program(rank, backend=backend)
        self.loss = StepLoss(
            program.loss_reduction,
            holds_loss=program.holds_loss(rank),
            data_parallel=self._dp,
            count_rides=self._step_program.count_slots() > 0,
        )
        self._context: StepContext  # what the executor reads: `_bind_step`, once state is placed
        self._executor: ModuleExecutor | PipelineExecutor | None = None
        self._sizes: dict[tuple, dict] = {}  # microbatch input shapes -> export's size symbols
        self._batch_rules = batch_rules(program.captured)  # what step() checks of a batch
        self._optimizers: list = []  # what `optimizer` made, for `memory_stats`
        self._groups: dict[int, ParameterGroups] = {}  # id of an optimizer it made -> its groups
        self._unstepped: list[str] = []  # trained parameters none of them steps, till a step warns
        self._saved = SavedTensorMeter()  # bytes held for backward, for `memory_stats`
        self._measured: set[tuple] = set()  # the input sizes the meter has measured a step at
        self.record_memory = False  # measure every step, not only the first at each size
        self._closed_by: str | None = None  # which close() ended this runner (live_runners)

    @property
    def module(self) -> torch.fx.GraphModule:
        """The rank's module (its first pipeline chunk with virtual stages)."""
        return self.modules[0]

    @property
    def executed_modules(self) -> tuple[torch.nn.Module, ...]:
        """What a step calls for each of `modules`: its graph (node names kept) reading the
        same parameters by flat names (`runtime.flat_reads`). Instrument these, not `modules`,
        to observe a step's values."""
        return self._context.forwards

    @property
    def receives_ahead(self) -> int:
        """How many actions ahead the pipeline executor posts receives: the backend's choice
        (`pipeline_program.receives_ahead`); the tests set it to run NCCL's order on gloo."""
        return self._context.receives_ahead

    @receives_ahead.setter
    def receives_ahead(self, actions: int) -> None:
        step_program = self.program.step_program(self.rank, receives_ahead=actions)
        self._context.receives_ahead = actions
        self._context.step_program, self._context.guard = step_program, StepGuard(step_program)

    @property
    def record_timeline(self) -> bool:
        """Set True to keep each pipeline action's start and end (`timeline()`)."""
        return self._context.record_timeline

    @record_timeline.setter
    def record_timeline(self, record: bool) -> None:
        self._context.record_timeline = record

    @classmethod
    def create(
        cls,
        program: CompiledProgram,
        *,
        timeout: timedelta | float,
        device: torch.device | str | None,
        backend: str | None,
        seed: int | None = None,
    ) -> Runner:
        timeout = bind_timeout(timeout)
        check_seed(seed)
        env = TorchrunEnvironment.read(expected_world_size=program.world_size)
        program.plan.check_world_size(env.world_size)
        live_runners.check_can_bind(program)
        device = bound_device(device, env.local_rank)
        backend = backend_for(device, backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tied = all_tied_groups(program)
        groups, tied_groups = init_process_groups(
            program.mesh,
            rank=env.rank,
            backend=backend,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
            extra=tied,
        )
        try:
            runner = cls(
                program, rank=env.rank, device=device, groups=groups, tied_groups=tied_groups,
                communicator=Communicator(timeout), backend=backend,
            )
            runner._place_state(seed)
            runner._bind_step()
        except BaseException:  # a bind that fails leaves no groups behind: bind may try again
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        buckets = runner._context.buckets  # the finalizer must not hold the runner itself
        live_runners.register(runner, release=lambda: [b.remove() for b in buckets])
        return runner

    # -- binding (`runtime.binding`) ---------------------------------------------------------

    def _place_state(self, seed: int | None = None) -> None:
        """Move this rank's state to its device, make every replica and tied copy identical,
        and agree on the job's random seed (`runtime.random_seed`)."""
        state = place_state(self.modules, self.device, loss=self.loss, eager=self.program.plan.compile == "eager")
        # Bound again at every step: another program bound in this process (a benchmark's
        # second runner) must not leave this one's ops counted by its communicator.
        self._axes = {axis.value: AxisOnGroup(group, self.communicator) for axis, group in self.groups.items()}
        bind_axes(self._axes)
        synchronise_copies(self.program, self.modules, state, rank=self.rank, dp=self._dp,
                           step_program=self._step_program, tied_groups=self._tied_groups,
                           communicator=self.communicator, edp=self.groups.get(Axis.EDP))
        seed = agree_seed(seed, rank=self.rank, world_size=self.world_size, communicator=self.communicator,
                          device=self.device)
        self._random = RandomStream(seed)
        bind_random(self._random)
        self.communicator.reset()
        self._masters = MasterWeights.keep(self.modules)  # bf16-mixed: bf16 working copies

    def _bind_step(self) -> None:
        """The gradient buckets, ZeRO's flat parameters and the executors' `StepContext`."""
        self._context, self._flat_parameters = step_context(
            self.program, self.modules, rank=self.rank, device=self.device, backend=self.backend,
            groups=self.groups, tied_groups=self._tied_groups, step_program=self._step_program,
            communicator=self.communicator, loss=self.loss, masters=self._masters, meter=self._saved,
            random=self._random,
        )
        self._executor = (
            ModuleExecutor(self._context) if self.program.stages is None
            else PipelineExecutor(self._context, self.program)
        )

    # -- training -------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.program.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def local_batch(self, *global_batch: torch.Tensor | Mapping[str, torch.Tensor], **keywords: torch.Tensor):
        """This rank's data-parallel slice (along dim 0) of each tensor of a global batch, in
        the form given: a tuple for tensors, a dict for a dict (or keywords) of tensors."""
        if len(global_batch) == 1 and isinstance(global_batch[0], Mapping) and not keywords:
            keywords, global_batch = dict(global_batch[0]), ()
        if keywords and global_batch:
            raise TypeError("pass a batch either positionally or by keyword, not both")
        named = keywords or {f"input {i}": t for i, t in enumerate(global_batch)}
        dp, index = self._dp.size, self._dp.ranks.index(self.rank)
        slices = {}
        for name, tensor in named.items():
            if tensor.shape[0] % dp:
                raise PlanError(
                    f"{name} has batch {tensor.shape[0]}, not divisible by dp={dp}. Fix: use "
                    f"a global batch that is a multiple of {dp}",
                    field="dp",
                    value=dp,
                )
            slices[name] = tensor.tensor_split(dp)[index]
        return slices if keywords else tuple(slices.values())

    def step(self, *local_batch: torch.Tensor | Mapping[str, torch.Tensor], **keywords: torch.Tensor) -> float:
        """Forward and backward over this rank's batch; returns the global-batch mean loss.

        The batch comes as the example did: tensors in order, a dict, or keywords. Gradients
        are left in the parameters' `.grad`, ready for the optimizer: exactly one device's
        over the global batch when the loss is a mean cross entropy, however many valid
        targets each piece holds (`runtime.step.loss`); for another loss, the average of the
        pieces' gradients. Without `opt.zero_grad()` since the last step they are added to
        that step's, as one device's second backward adds (`runtime.step.gradient_accumulation`).
        Every call counts as a step, a failing one too: the ranks agree on the count before
        the step moves any data, or stop with StepMismatchError naming both steps
        (`runtime.step.agreement`). A batch unlike the example (an input missing, of another
        rank, dtype, device or fixed size, empty, longer than the model's positions, or a
        label outside the vocabulary) is a BatchError on every rank given it, before the step
        communicates (`runtime.step.batch_checks`).
        """
        self._require_open("step")
        if self._unstepped:  # once per set of optimizers
            self._unstepped = warn_unstepped(self._unstepped)
        self._context.steps += 1  # every call counts, a failing one too (runtime.step.agreement)
        inputs = self.program.captured.arrange(local_batch, keywords)
        chunks = self._microbatches(inputs)
        shapes = tuple(t.shape for t in chunks[0])
        if shapes not in self._sizes:  # export's size symbols at this step's sizes
            self._sizes[shapes] = self.program.microbatch_sizes(chunks[0])
        guard = self._context.guard
        guard.start(self._sizes[shapes])
        self.communicator.start_step(guard, step=self._context.steps)
        bind_axes(self._axes)
        bind_random(self._random)
        # The saved-tensor meter costs a Python call per saved tensor: it measures the first
        # step at each input size (what a step saves depends on nothing else) and every step
        # with `record_memory`. Activations are what the step makes: model state and the batch
        # it was given are not.
        measure = self.record_memory or shapes not in self._measured
        self._measured.add(shapes)
        given = [t for m in self.modules for t in (*m.parameters(), *m.buffers())] + list(inputs) if measure else ()
        earlier = EarlierGradients.set_aside(self._context)  # no zero_grad since: added back after
        try:
            with self._saved.measuring(given) if measure else contextlib.nullcontext():
                loss = self._executor.run(chunks, self._sizes[shapes])
        except BaseException:
            earlier.put_back()
            self.communicator.end_step(check=False)  # a failed step leaves no guard behind
            raise
        earlier.add_back()  # one device's accumulation (`runtime.step.gradient_accumulation`)
        self.communicator.end_step()
        self._random.step += 1
        return loss

    def _microbatches(self, inputs: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
        """`inputs` (a step's batch in graph order) checked against the program and split into
        its microbatches: each a tuple of the inputs' pieces along dim 0. Raises before the
        step communicates."""
        check_batch(self._batch_rules, inputs, device=self.device)  # BatchError before any collective
        plan = self.program.plan
        if plan.sequence_parallel or plan.cp > 1:  # an uneven shard would abort inside gloo
            for length in self.program.captured.sequence_lengths(inputs):
                plan.check_sequence(length, what="this step's sequence length")
        batch = inputs[0].shape[0]
        if batch % plan.microbatches:
            raise PlanError(
                f"this rank's batch of {batch} does not split into microbatches={plan.microbatches}. "
                f"Fix: make the local batch a multiple of {plan.microbatches}",
                field="microbatches",
                value=plan.microbatches,
            )
        return list(zip(*(t.tensor_split(plan.microbatches) for t in inputs)))

    def rng_state(self) -> dict[str, int]:
        """What resumes this run's random draws: `{"seed": ..., "step": ...}`, the same on
        every rank (`fxpar.ops.random_streams`); a checkpoint saves it."""
        return self._random.state()

    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], *, param_groups: list[dict] | None = None,
        elementwise: bool = False, **options: Any,
    ):
        """`optimizer_class` over this rank's parameters (each tied group once); under ZeRO-1/2
        over this rank's shards of them (`runtime.state.sharded_optimizer`). Where it would step a
        piece of a parameter (ZeRO, tp shards) it must be elementwise, which `elementwise=True`
        vouches for a class fxpar does not know (`runtime.state.optimizer_reads`). `options` are the
        defaults, passed through (`fused=`, `foreach=`; on CUDA Adam, AdamW and SGD are fused
        unless told otherwise: `runtime.state.optimizer_defaults`); `param_groups`, as
        torch.optim takes them but naming the compiled model's Parameters or their names, gives
        groups their own (`runtime.state.parameter_groups`)."""
        self._require_open("optimizer")
        options = with_defaults(optimizer_class, options, self.device)
        captured = self.program.captured
        groups = (ParameterGroups.whole(captured.parameters, captured.aliases) if param_groups is None
                  else ParameterGroups.resolve(param_groups, captured.parameters, captured.aliases))
        if self._flat_parameters:
            optimizer = ShardedOptimizer(optimizer_class, options, context=self._context, groups=groups,
                                         flats=self._flat_parameters, elementwise=elementwise,
                                         masters=self._masters)
        else:
            require_elementwise_for_pieces(optimizer_class, self.modules, lambda n: groups.group_of(n) is not None,
                                           plan=self.program.plan, elementwise=elementwise)
            stepped = groups.torch_groups((group, p) for name, p in parameters_of(self.modules)
                                          if (group := groups.group_of(name)) is not None)
            optimizer = (MixedPrecisionOptimizer(optimizer_class, options, masters=self._masters, param_groups=stepped)
                         if self._masters else optimizer_class(stepped, **options))
        self._optimizers.append(optimizer)
        record_maker(optimizer, self)  # a checkpoint refuses it with another runner
        self._groups[id(optimizer)] = groups
        self._unstepped = [n for m in self.modules for n in sorted(meta.trained_parameters(m))
                           if all(g.group_of(n) is None for g in self._groups.values())]
        return optimizer

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole model: the norm of all its gradients
        as one device has them (each element once, however this rank holds it), every rank's
        gradients scaled by the same coefficient; returns that norm. Call it after `step()`,
        before `optimizer.step()`, on every rank (`runtime.state.gradient_norm`)."""
        self._require_open("clip_grad_norm_")
        return clip_grad_norm_(self._rank_state(), self.communicator, max_norm, norm_type,
                               sharded=bool(self._flat_parameters))

    def memory_stats(self) -> dict[str, int | None]:
        """Bytes this rank holds: `params`, `grads`, `optimizer` (the state of the optimizers
        `runner.optimizer` made), counted from its tensors, `activations` (held for backward at
        their peak during the last measured step, the first at each input size or every one with
        `record_memory = True`: `runtime.step.saved_tensors`) and the allocator's `peak`
        on CUDA (`runtime.memory_stats`); `program.estimate().memory` predicts them."""
        stats = model_state_bytes(self.modules, self._context.buckets, self._optimizers, self.device,
                                  masters=self._masters.tensors())
        order = ("params", "grads", "optimizer", "activations", "peak")
        return {key: {**stats, "activations": self._saved.peak}[key] for key in order}

    # -- observation ----------------------------------------------------------------------

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Per collective kind, `count` and payload `bytes` since bind or the last reset."""
        return self.communicator.stats()

    def comm_log(self) -> list:
        """The collectives of the last step, in issue order, as `fxpar.ir.collectives.Collective`."""
        return list(self.communicator.log)

    def reset_comm_stats(self) -> None:
        self.communicator.reset()

    def timeline(self) -> list[tuple[str, float, float]]:
        """With `record_timeline = True`: (action, start, end) of every pipeline action of the
        last step, in seconds of `time.perf_counter`."""
        return list(self._executor.timeline) if self._executor is not None else []

    def close(self) -> None:
        """End this runner and every other live one of the process, and destroy the process
        groups they share (all ranks must call it; a second call does nothing).

        Each runner's hooks are removed and its axes unbound; using it to train afterwards is a
        BindError, and `program.bind()` may bind again (`runtime.live_runners`). Every
        reference to a group goes first: a gloo group that outlives `destroy_process_group`
        until interpreter exit can abort the process there.
        """
        if self._closed_by is not None:
            return
        closed_by = f"runner.close() of the runner of plan '{self.program.plan}'"
        for runner in {*live_runners.end_all(), self}:
            runner._end(closed_by)
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    def _end(self, closed_by: str) -> None:
        for buckets in self._context.buckets:
            buckets.remove()
        unbind_axes(self._axes)
        unbind_random(self._random)
        self.groups, self._tied_groups = {}, {}
        self._context, self._executor = replace(self._context, buckets=(), groups={}), None
        self._dp = replace(self._dp, handle=None)
        self._closed_by = closed_by

    def _require_open(self, method: str) -> None:
        if self._closed_by is not None:
            raise BindError(
                f"runner.{method}() on a closed runner (plan '{self.program.plan}', rank "
                f"{self.rank}): {self._closed_by} ended it and destroyed this process's groups, "
                "so it would train without synchronising anything. Fix: bind again "
                "(runner = program.bind()) and use the new runner"
            )

