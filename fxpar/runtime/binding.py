"""Binding: the work `program.bind()` does once, between torchrun's environment and the first step.

`Runner.create` runs it in this order, each step a function here that takes what it needs:

    bound_device, backend_for   the rank's device (`cuda:LOCAL_RANK` when CUDA is there) and
                                the backend for it (NCCL on CUDA, gloo otherwise;
                                `fxpar.ir.collectives.backend_for`)
    all_tied_groups             the extra groups a pipeline's tied parameters need, created with
                                the mesh's groups (`process_groups.init_process_groups`)
    place_state                 every parameter and buffer on that device, the graphs' own
                                constants too, and the distributed ops lowered for eager runs
    synchronise_copies          every data-parallel replica and tied copy made the first rank's
                                (what DDP does at construction)
    step_context                the gradient buckets, ZeRO's flat parameters and gatherers, and
                                the `StepContext` the executors read

The runner then agrees on the seed and keeps the master weights (`Runner._place_state`); after
binding only `runner.step` and the optimizer move data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpar.compiler import lowering
from fxpar.compiler.pipeline_program import receives_ahead
from fxpar.compiler.reduction_lowering import PARTIAL_AXES
from fxpar.errors import BindError
from fxpar.ir import meta
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.mesh import Axis
from fxpar.ir.placement import Shard
from fxpar.ir.step_program import Communicate, Purpose, StepProgram
from fxpar.ops.distributed import lower_for_eager
from fxpar.ops.traced_collectives import compiled_form
from fxpar.ops.random_streams import RandomStream
from fxpar.runtime.checkpoint.whole_state import graph_parameters
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.compiled_forward import compiled_forwards
from fxpar.runtime.flat_reads import reading_flat
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.state.gradient_buckets import GradientBuckets
from fxpar.runtime.state.master_weights import MasterWeights
from fxpar.runtime.state.parameter_gatherer import ParameterGatherer
from fxpar.runtime.state.sharded_optimizer import flatten_parameters
from fxpar.runtime.state.zero3_state import broadcast_sharded_parameters, dp_sharded_parameters
from fxpar.runtime.step.context import StepContext
from fxpar.runtime.step.guard import StepGuard
from fxpar.runtime.step.loss import StepLoss
from fxpar.runtime.step.recompute import read_gathered_through, recomputing
from fxpar.runtime.step.saved_tensors import SavedTensorMeter
from fxpar.runtime.step.valid_targets import CountArrival, await_count


def bound_device(device: torch.device | str | None, local_rank: int) -> torch.device:
    """`device` as given (a bare "cuda" is this process's `cuda:LOCAL_RANK`), or by default
    `cuda:LOCAL_RANK` (modulo the visible devices) when CUDA is available, else the CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank)
    return device


def all_tied_groups(program: CompiledProgram) -> tuple[tuple[int, ...], ...]:
    """Every group of ranks that keeps a tied parameter identical, in one order on all ranks."""
    if program.stages is None:
        return ()
    return tuple(sorted({g for by_name in lowering.tied_groups(program).values() for g in by_name.values()}))


def parameters_of(modules: Iterable[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter of `modules`, each tied one once (its first name)."""
    seen, result = set(), []
    for module in modules:
        for name, parameter in graph_parameters(module).items():
            if id(parameter) not in seen:
                seen.add(id(parameter))
                result.append((name, parameter))
    return result


def place_state(
    modules: Sequence[torch.fx.GraphModule], device: torch.device, *, loss: StepLoss, eager: bool = True
) -> list[torch.Tensor]:
    """Move the rank's parameters and buffers to `device` and return them; put the tensors the
    graphs create there too, and lower the distributed ops for eager runs (of the loss's
    count module as well, where the loss is a sum over valid targets); a compiled module keeps
    the registered ops, which Inductor sees (`runtime.compiled_forward`)."""
    state = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    if any(t.is_meta for t in state):
        raise BindError(
            "the model's parameters are on the meta device, which is for planning only. "
            "Fix: build the model on a real device (or `model.to_empty(device=...)` and "
            "initialise it) before fxpar.compile when you mean to train"
        )
    with torch.no_grad():
        for tensor in state:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)
    for module in (*modules, *filter(None, [loss.reduction.count_module])):
        place_graph_constants(module, device)
        if eager or module not in modules:
            lower_for_eager(module)
    return state


def synchronise_copies(
    program: CompiledProgram,
    modules: Sequence[torch.fx.GraphModule],
    state: list[torch.Tensor],
    *,
    rank: int,
    dp: RankGroup,
    step_program: StepProgram,
    tied_groups: dict[tuple[int, ...], RankGroup],
    communicator: Communicator,
    edp: RankGroup | None = None,
) -> None:
    """Make every data-parallel replica of `state` and every tied parameter's copies identical:
    broadcast from the group's first rank (an expert's weights from the first rank holding
    the same experts, over `edp`)."""
    def broadcast(tensors: list[torch.Tensor], group: RankGroup) -> None:
        broadcast_by_dtype(tensors, group, communicator)

    if dp.size > 1:
        # DDP does the same at construction: every replica starts from the first rank's
        # values, whatever seed each process used (ZeRO-3's pieces: `zero3_state`).
        sharded = dp_sharded_parameters(modules)
        experts = expert_parameters(modules)
        broadcast([t for t in state if id(t) not in sharded and id(t) not in experts], dp)
        if experts and edp is not None and edp.size > 1:
            broadcast([t for t in state if id(t) in experts], edp)
        if sharded:
            broadcast_sharded_parameters(program, modules, rank, dp, broadcast)
    mine = dict(parameters_of(modules))
    for name, group in step_program.tied_groups.items():
        broadcast([mine[name]], tied_groups[group])


def expert_parameters(modules: Sequence[torch.fx.GraphModule]) -> set[int]:
    """The ids of the parameters split over ep (`passes.expert_parallel`): each rank's are its
    own experts, copies only over edp."""
    return {id(m.get_parameter(name)) for m in modules for name, node in meta.parameter_nodes(m.graph).items()
            if isinstance(meta.placement(node, "ep"), Shard)}


def broadcast_by_dtype(tensors: list[torch.Tensor], group: RankGroup, communicator: Communicator) -> None:
    """Overwrite `tensors` with the group's first rank's values: one flat broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, same in by_dtype.items():
            flat = _flatten_dense_tensors([t.data for t in same])
            communicator.broadcast(flat, group, tag=f"initial {dtype} state")
            for t, synced in zip(same, _unflatten_dense_tensors(flat, same)):
                t.copy_(synced)


def step_context(
    program: CompiledProgram,
    modules: Sequence[torch.fx.GraphModule],
    *,
    rank: int,
    device: torch.device,
    backend: str,
    groups: dict[Axis, RankGroup],
    tied_groups: dict[tuple[int, ...], RankGroup],
    step_program: StepProgram,
    communicator: Communicator,
    loss: StepLoss,
    masters: MasterWeights,
    meter: SavedTensorMeter,
    random: RandomStream,
) -> tuple[StepContext, list]:
    """The gradient buckets (with data parallelism: `_gradient_buckets`), ZeRO's flat parameters
    (per module, per bucket; the master weights sharded to them), ZeRO-3's gatherers
    (`_parameter_gatherers`) and the `StepContext` the executors read."""
    dp = groups[Axis.DP]
    buckets = _gradient_buckets(program, modules, dp=dp, step_program=step_program,
                                communicator=communicator, loss=loss)
    # ZeRO: parameters live in flat per-bucket buffers, whose shards the optimizer steps.
    flat_parameters = [flatten_parameters(b) for b in buckets] if program.plan.zero else []
    if flat_parameters:
        masters.shard(buckets)
    mine = dict(parameters_of(modules))
    compiled = program.plan.compile == "inductor"
    gatherers = () if compiled else _parameter_gatherers(program, modules, dp=dp, communicator=communicator)
    arrival = CountArrival()  # the graphs wait for the step's count where they read it
    for module in modules if not compiled else ():  # a compiled forward settles it first
        await_count(module, arrival)
    if compiled:  # ZeRO-3's gathers run inside the compiled graph, re-gathered by recomputation
        forwards = tuple(reading_flat(recomputing(compiled_form(m), None)) for m in modules)
    else:
        forwards = tuple(reading_flat(recomputing(m, meter)) for m in modules)
    for forward, gatherer in zip(forwards, gatherers):  # ZeRO-3: regions take gathered weights as recipes
        read_gathered_through(forward, gatherer)
    if compiled:
        forwards = compiled_forwards(forwards, arrival, gathers_ahead=program.plan.gathers_ahead)
    context = StepContext(
        rank=rank, device=device, step_program=step_program,
        guard=StepGuard(step_program), modules=tuple(modules),
        forwards=forwards,
        module_of_stage={meta.stage_of(m): i for i, m in enumerate(modules)},
        buckets=tuple(buckets),
        # Replicated parameters whose gradient each tp rank holds a summand of, per module.
        partial_gradients=tuple(
            {axis: [m.get_parameter(name) for name in meta.partial_gradient_parameters(m.graph, axis)]
             for axis in PARTIAL_AXES}
            for m in modules
        ),
        tied={name: (mine[name], tied_groups[group]) for name, group in step_program.tied_groups.items()},
        loss=loss, communicator=communicator, groups=groups,
        receives_ahead=receives_ahead(backend), gatherers=gatherers, random=random,
        meter=meter, count_arrival=arrival, input_names=program.captured.input_names,
    )
    return context, flat_parameters


def _gradient_buckets(
    program: CompiledProgram,
    modules: Sequence[torch.fx.GraphModule],
    *,
    dp: RankGroup,
    step_program: StepProgram,
    communicator: Communicator,
    loss: StepLoss,
) -> list[GradientBuckets]:
    """One `GradientBuckets` per module, each reducing its stage's buckets with the calls the
    step program gives them, where gradients are reduced over dp in buckets: none on one dp
    rank, none under ZeRO-3, whose gradients the graph's own ops reduce-scatter."""
    stages, plan, buckets = program.stages, program.plan, []
    per_microbatch = program.zero_reduce.per_microbatch  # ZeRO-2/3 (`fxpar.plan.zero_reduction`)
    for module in modules if dp.size > 1 and plan.zero < 3 else ():
        stage = meta.stage_of(module)
        assignment = stages[stage].buckets if stages else program.buckets
        calls: dict[int, list] = {}  # bucket -> its reductions (per microbatch, or one)
        for a in step_program.actions:
            if isinstance(a, Communicate) and a.purpose is Purpose.GRADIENT_BUCKET and a.stage == stage:
                calls.setdefault(a.index, []).append(a.calls[0])
        buckets.append(GradientBuckets(
            assignment, graph_parameters(module), dp, communicator, calls,
            # the loss rides in the last bucket, unless its sum over cp must follow the bucket's over dp
            carry_loss=stages is None and plan.cp == 1, average=not loss.sums, zero=plan.zero,
            per_microbatch=per_microbatch,
        ))
    return buckets


def _parameter_gatherers(
    program: CompiledProgram, modules: Sequence[torch.fx.GraphModule], *, dp: RankGroup, communicator: Communicator
) -> tuple[ParameterGatherer, ...]:
    """ZeRO-3 over more than one dp rank in eager mode: one `ParameterGatherer` per module, which
    runs the module's gathers of its layers' parameters; none otherwise (a compiled module runs
    the registered ops: `ops.recomputed_gathers`)."""
    plan = program.plan
    if not (plan.zero == 3 and dp.size > 1):
        return ()
    return tuple(
        ParameterGatherer(m, dp, communicator, prefetch=plan.gathers_ahead,
                          reshard_after_forward=plan.reshard_after_forward,
                          per_microbatch=program.zero_reduce.per_microbatch)
        for m in modules
    )


def place_graph_constants(module: torch.fx.GraphModule, device: torch.device) -> None:
    """Tensors the graph creates (positions from `arange`) on this rank's device.

    Export records the device of the capture (`device=cpu`); the rank may run elsewhere.
    """
    changed = False
    for node in module.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] != device:
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        module.recompile()
