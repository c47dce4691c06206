"""`fxpar.compile` and `Program`: the whole job as data, before any process exists.

A Program holds the captured graph after every pass has annotated or rewritten it, plus the
plan and mesh. Everything on it is pure: `rank_module(517)` of a 1024-rank plan prints the
code rank 517 will run on a laptop, `collectives(r)` lists what rank r will communicate in
one step and `check()` proves that all ranks agree. Only `bind()` touches the environment.

Passes run in one order, built from the plan (`fxpar.compiler.pass_list`, whose [Note: pass order]
says why; `fxpar.compiler.compilation` runs them): tensor parallelism rewrites the graph for local shards, placements are set on the
dp axis, then either gradient buckets are assigned or, with a pipeline, the graph is cut into
`program.stages` (each with its own buckets), which `program.schedule` orders. Lowering then
writes each rank's step program (`step_program`).

    program = fxpar.compile(model, "dp=2", example_inputs=(tokens, labels))
    print(program.rank_module(1).code)
    program.check()
    runner = program.bind()          # inside torchrun
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxpar.compiler.compilation import captured_of, compile_graph
from fxpar.compiler.full_state_lowering import lower_full_state
from fxpar.compiler.lowering import lower_row, tied_groups
from fxpar.compiler.pass_list import PassList
from fxpar.compiler.pipeline_program import (
    check_pipeline,
    describe_stages,
    node_time,
    receives_ahead as pipeline_receives_ahead,  # collectives() has a parameter of that name
)
from fxpar.compiler.rank_specialisation import specialise
from fxpar.cost.profiles import hardware_profile
from fxpar.errors import PlanError
from fxpar.frontend import step_sizes
from fxpar.frontend.model_io import ExampleInputs
from fxpar.frontend.replaced_state import check_state_not_replaced
from fxpar.frontend.trace import CapturedGraph
from fxpar.ir import meta
from fxpar.ir.buckets import Bucket
from fxpar.ir.collectives import Collective, check_collectives
from fxpar.ir.loss_reduction import COUNT_INPUT, LossReduction
from fxpar.ir.mesh import Mesh
from fxpar.ir.stages import Stage
from fxpar.ir.step_program import StepProgram
from fxpar.plan.plan import Plan
from fxpar.plan.zero_reduction import ZeroReduction, decide, fixed
from fxpar.planner.auto import search_plans
from fxpar.planner.search import PlanSearch
from fxpar.schedule.schedules import Schedule

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path
    from typing import Literal

    from fxpar.cost.estimate import Estimate
    from fxpar.runtime.runner import Runner


def compile(
    model: torch.nn.Module | CapturedGraph,
    plan: Plan | str | dict,
    example_inputs: ExampleInputs | None = None,
    *,
    hardware: str | None = None,
    check: bool = True,
    world_size: int | None = None,
    memory_per_device: float | str | None = None,
) -> Program:
    """Capture `model(*example_inputs) -> loss` and compile it for `plan`.

    `model` may also be a capture (`fxpar.capture(model, example_inputs)`), to compile many
    plans of one model with one torch.export; then `example_inputs` is not given.

    `example_inputs` is one *global* batch, what a single device would train on; each input's
    dim 0 is the batch. A tuple is passed positionally, a dict by keyword (a Hugging Face
    model: `{"input_ids": ids, "labels": labels}`); the model returns its loss, alone, first
    in a tuple, or as the `loss` of its output (`trace.capture`). `hardware` names the cost
    profile that sizes gradient buckets and prices the pipeline cut (default: "h100" when CUDA
    is available, else "cpu"); the plan's `bucket_mb` overrides the bucket size.
    Raises PlanError for a plan that does not fit the model or batch, CaptureError for a model
    that cannot be captured. With `check` (the default), the compiled program is proved before
    it is returned (`Program.prove`: every group's calls match, every send has its receive, the
    schedule cannot deadlock); `check=False` skips it, for tools that prove it themselves.

    `plan="auto"` compiles the plan `plan_auto` chooses for `world_size` devices (default:
    torchrun's WORLD_SIZE) of `memory_per_device` each (default: this machine's, see
    `fxpar.planner.budget`); `program.plan` is the choice.
    """
    auto = isinstance(plan, str) and plan.strip().lower() == "auto"
    plan = plan if auto else Plan.parse(plan)  # a bad plan is refused before the capture
    captured = captured_of(model, example_inputs)
    hardware = hardware or default_hardware()
    if auto:
        plan = plan_auto(captured, world_size=world_from_launch(world_size), hardware=hardware,
                         memory_per_device=memory_per_device, measured=False).plan  # alike on every rank
    compiled = compile_graph(captured, plan, hardware=hardware)  # checks, passes, warnings, stages
    program = Program(plan=plan, mesh=compiled.mesh, captured=captured, graph_module=compiled.graph_module,
                      stages=compiled.stages, hardware=hardware, passes=compiled.passes)
    if check:
        program.prove()
    return program


def plan_auto(
    model: torch.nn.Module | CapturedGraph,
    example_inputs: ExampleInputs | None = None,
    *,
    world_size: int,
    memory_per_device: float | str | None = None,
    hardware: str | None = None,
    devices_per_node: int | None = None,
    fixed: str | dict | None = None,
    optimizer: str = "adamw",
    measured: bool = True,
) -> PlanSearch:
    """Choose a plan for `world_size` devices: every candidate (`fxpar.planner.space`) compiled
    from one capture, priced by its own `estimate()`, the fastest that fits the memory chosen.

        search = fxpar.plan_auto(model, (tokens, labels), world_size=8, memory_per_device="80GB",
                                 hardware="h100", fixed="precision=bf16-mixed")
        print(search.table())    # the choice, the ten fastest, and why the others were left out
        program = fxpar.compile(model, search.plan, (tokens, labels))

    `memory_per_device` is bytes or text ("80GB", "24GiB"; default this machine's),
    `devices_per_node` bounds tp (default the profile's), `fixed` holds plan fields every
    candidate keeps; `measured=False` prices "cpu" with nominal constants instead of this
    machine's (`cost.profiles`). A PlanError when no plan fits names the least memory one needs,
    and the plan.
    """
    return search_plans(captured_of(model, example_inputs), compile_plan=compile, world_size=world_size,
                        hardware=hardware or default_hardware(),
                        memory_per_device=memory_per_device, devices_per_node=devices_per_node,
                        fixed=fixed, optimizer=optimizer, measured=measured)


def default_hardware() -> str:
    """The cost profile compile and the planner use when none is named: "h100" where CUDA is,
    else "cpu"."""
    return "h100" if torch.cuda.is_available() else "cpu"


def world_from_launch(world_size: int | None) -> int:
    """`world_size` as given, else torchrun's WORLD_SIZE; a PlanError without either."""
    if world_size is None and (world_size := os.environ.get("WORLD_SIZE")) is None:
        raise PlanError(
            "plan 'auto' searches plans for a number of devices, and neither world_size nor "
            "torchrun's WORLD_SIZE gives it. Fix: fxpar.compile(model, 'auto', inputs, "
            "world_size=8), or run under torchrun",
            field="world_size", value=None)
    if not str(world_size).isdigit() or int(world_size) < 1:
        raise PlanError(f"world_size must be a positive integer, got {world_size!r}. Fix: world_size=8",
                        field="world_size", value=world_size)
    return int(world_size)


class Program:
    """The compiled job: the global annotated graph, the plan and the mesh (see module doc).

    `pickle.dumps(program)` works, and `pickle.loads` compiles again from what it was made of:
    the capture (which pickles as the model and its example inputs, `trace.CapturedGraph`),
    the plan and the hardware profile. Compilation is deterministic, so the loaded program's
    `rank_module(r).code` and `collectives(r)` are the original's; loading costs a capture
    and a compile, and needs the model's class importable. Programs pickled together from one
    capture load sharing one capture again; step programs set by `replace_step_program` come
    back with them.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        mesh: Mesh,
        captured: CapturedGraph,
        graph_module: fx.GraphModule,
        stages: tuple[Stage, ...] | None = None,
        hardware: str = "h100",
        passes: PassList | None = None,
    ):
        self.plan = plan
        self.passes = passes  # what compile ran (`print(program.passes)`)
        self.hardware = hardware  # the profile compile priced the cut and the buckets with
        self.mesh = mesh
        self.captured = captured
        self.graph_module = graph_module
        self.stages = stages  # pipeline stages, or None without a pipeline
        self.schedule: Schedule | None = passes.schedule if passes is not None else None  # the cut's own
        self._rows: dict[tuple, tuple] = {}  # lowered actions: (pp rank, receives ahead, per microbatch), state
        self._tied_groups: dict[int, dict[str, tuple[int, ...]]] | None = None
        self._edited: dict[int, StepProgram] = {}  # replace_step_program

    @functools.cached_property
    def zero_reduce(self) -> ZeroReduction:
        """When ZeRO-2/3 reduce-scatter gradients, per microbatch or per step, and why: the
        plan's `zero_reduce`, or with "auto" the mode the cost model prices cheaper on the
        profile compile used (`fxpar.plan.zero_reduction`). Lowering reads it."""
        from fxpar.cost.estimate import exposed_comm_seconds

        if (known := fixed(self.plan)) is not None:
            return known
        device = hardware_profile(self.hardware, measured=False)  # every rank decides alike
        priced = {mode: exposed_comm_seconds(self, device, functools.partial(self._lowered, per_microbatch=each))
                  for mode, each in (("microbatch", True), ("step", False))}
        return decide({mode: exposed for mode, (exposed, _) in priced.items()}, compute=priced["step"][1],
                      hardware=device.name)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Gradient buckets in launch order (bucket 0's gradients are ready first).

        With a pipeline each stage has its own: `program.stages[i].buckets`.
        """
        if self.stages is not None:
            raise AttributeError("a pipelined program has buckets per stage: program.stages[i].buckets")
        return meta.graph_buckets(self.graph_module)

    @property
    def loss_reduction(self) -> LossReduction:
        """How the step's pieces combine into the one-device loss (passes.loss_normalisation)."""
        return meta.graph_loss(self.graph_module)

    @property
    def input_names(self) -> tuple[str, ...]:
        """What each rank module's forward takes: the step's inputs, then `valid_targets` when
        the loss is a sum over the global count of valid targets."""
        return self.captured.input_names + ((COUNT_INPUT,) if self.loss_reduction.sums else ())

    def holds_loss(self, rank: int) -> bool:
        """Whether `rank` computes the loss: every rank, or a pipeline's last stage's ranks."""
        if self.stages is None:
            return True
        return self.mesh.coord(rank).pp == self.schedule.rank_of(len(self.stages) - 1)

    def rank_module(self, rank: int) -> fx.GraphModule:
        """The GraphModule `rank` runs, with readable `.code`: its stage, with a pipeline
        (its first chunk with virtual stages; `stage_modules` gives all of them).

        Replicated parameters are the model's own tensors; tensor-parallel ones are copies of
        this rank's slices (of meta tensors, for a meta model: nothing is allocated).
        """
        return self.stage_modules(rank)[0]

    def stage_modules(self, rank: int) -> list[fx.GraphModule]:
        """The GraphModules `rank` runs: one, or one per pipeline chunk it holds, in stage order."""
        coord = self.mesh.coord(rank)
        if self.stages is None:
            return [specialise(self.graph_module, rank, self.mesh)]
        return [
            specialise(stage.graph_module, rank, self.mesh)
            for stage in self.stages
            if self.schedule.rank_of(stage.index) == coord.pp
        ]

    def stage_template(self, stage: int) -> fx.GraphModule:
        """Stage `stage`'s GraphModule before rank specialisation: global values, every rank's."""
        return self.graph_module if self.stages is None else self.stages[stage].graph_module

    def step_program(
        self, rank: int, *, backend: str = "nccl", receives_ahead: int | None = None
    ) -> StepProgram:
        """Everything `rank` does in one training step, in order (`fxpar.ir.step_program`): what
        `collectives`, `check`, the cost model and the runtime read.

        The backend only moves a pipeline's receives in that order (on gloo they are posted
        one action ahead: `pipeline_program.receives_ahead`, which `receives_ahead` overrides
        as `Runner.receives_ahead` does); what is sent and received is the same.
        """
        if rank in self._edited:
            return self._edited[rank]
        return self._lowered(rank, backend=backend, receives_ahead=receives_ahead,
                             per_microbatch=self.zero_reduce.per_microbatch)

    def _lowered(self, rank: int, *, per_microbatch: bool, backend: str = "nccl",
                 receives_ahead: int | None = None) -> StepProgram:
        """`rank`'s step program as lowering writes it, ZeRO-2/3 reducing `per_microbatch` or
        per step: the program's own (`step_program`), or either mode `zero_reduce` prices."""
        ahead = pipeline_receives_ahead(backend) if receives_ahead is None else receives_ahead
        coord = self.mesh.coord(rank)
        key = (coord.pp, ahead if self.stages is not None else 0, per_microbatch)
        if key not in self._rows:
            self._rows[key] = lower_row(self, coord.pp, key[1], per_microbatch=per_microbatch)
        if self._tied_groups is None:
            self._tied_groups = tied_groups(self)
        stage_ranks = tuple(self.schedule.rank_of(s.index) for s in self.stages) if self.stages else ()
        actions, optimizer = self._rows[key]
        return StepProgram(rank=rank, mesh=self.mesh, actions=actions, optimizer=optimizer,
                           stage_ranks=stage_ranks, tied_groups=self._tied_groups.get(rank, {}))

    def state_program(self, rank: int, *, gradients: bool = False) -> StepProgram:
        """What `rank` issues to gather the whole model state (`runner.full_state_dict()`) or,
        with `gradients`, every trained parameter's whole gradient (`runner.full_gradients()`):
        tp shards gathered, then each pipeline rank's tensors broadcast (`full_state_lowering.lower_full_state`)."""
        key = ("state", self.mesh.coord(rank).pp, gradients)
        if key not in self._rows:
            self._rows[key] = lower_full_state(self, key[1], gradients=gradients)
        return StepProgram(rank=rank, mesh=self.mesh, actions=self._rows[key])

    def replace_step_program(self, rank: int, program: StepProgram) -> None:
        """Make `program` rank `rank`'s step program, for every reader: `collectives`, `check`,
        `estimate` and `bind`. For tools and tests that edit one rank's step (a dropped,
        swapped or resized call shows in the check and in the run alike)."""
        if program.rank != rank:
            raise ValueError(f"a step program of rank {program.rank} cannot be rank {rank}'s")
        self._edited[rank] = program

    def collectives(
        self, rank: int, *, backend: str = "nccl", receives_ahead: int | None = None
    ) -> tuple[Collective, ...]:
        """Every collective `rank` issues in one training step, in issue order, at the
        example's sizes: its step program's calls (`step_program`; `reduction_lowering.bucket_actions`
        says what each ZeRO stage issues)."""
        program = self.step_program(rank, backend=backend, receives_ahead=receives_ahead)
        return program.collectives(self.example_sizes)

    @functools.cached_property
    def example_sizes(self) -> dict:
        """Export's size symbols -> their values in one microbatch of the example's global
        batch (`step_sizes.example_sizes`): what `collectives` and `check` evaluate at."""
        return step_sizes.example_sizes(self.captured, microbatches=self.plan.microbatches)

    def microbatch_sizes(self, microbatch: tuple[torch.Tensor, ...]) -> dict:
        """The same symbols' values in a step's microbatch, read off this rank's piece of it
        (its inputs, in `input_names` order; `step_sizes.microbatch_sizes`)."""
        return step_sizes.microbatch_sizes(self.graph_module, microbatch, self.mesh.sizes)

    def describe_stages(self) -> str:
        """The pipeline cut the compiler chose: per stage its modules, parameters, share of the
        step's time (priced as the cut was, on `self.hardware`) and the shapes it receives (as
        formulas in batch and seq)."""
        if self.stages is None:
            return "no pipeline (pp=1)"
        cost = node_time(self.captured, hardware_profile(self.hardware, measured=False),
                         precision=self.plan.compute_precision)
        return describe_stages(self.stages, self.schedule, self.captured, cost)

    def estimate(
        self,
        hardware: str = "h100",
        *,
        optimizer: str = "adamw",
        batch: int | None = None,
        seq: int | None = None,
    ) -> Estimate:
        """Predict FLOPs, memory, bytes moved and time of one step (see `fxpar.cost.estimate`).

        Evaluated at the example inputs' batch and seq unless given; `hardware` is a profile
        name ("cpu" is measured on this machine) and `optimizer` one of adamw, adam, sgd,
        sgd-momentum.
        """
        from fxpar.cost.estimate import estimate

        return estimate(self, hardware=hardware, optimizer=optimizer, batch=batch, seq=seq)

    def check(self) -> None:
        """Prove that all ranks of every process group issue matching collectives, in a step
        and when gathering the full state (or gradients), and, with a pipeline, that every send
        has its receive and the schedule cannot deadlock: `prove()`, which `compile` runs
        unless `check=False`; call it again after `replace_step_program`."""
        self.prove()

    def prove(self) -> None:
        """The proof of `check()` (what `compile` runs).

        Ranks of one pipeline row run the same actions (`lowering`): on a dp or tp group every
        member runs one row, so those groups match by construction, and every (dp, tp)
        coordinate's pipeline groups, tied groups and transfers are alike. The proof compares
        one representative rank per row (dp = tp = 0) on the groups they fill, so it costs
        the pipeline degree, not the world size; once a step program is edited
        (`replace_step_program`), every rank is compared."""
        if self._edited:
            ranks, whole = range(self.world_size), False
        else:
            ranks, whole = [self.mesh.rank_of(pp=pp) for pp in range(self.mesh.pp)], True
        check_collectives(ranks, self.collectives, whole_groups_only=whole)
        for gradients in (False, True):
            state_calls = lambda r, g=gradients: self.state_program(r, gradients=g).collectives({})  # noqa: E731
            check_collectives(ranks, state_calls, whole_groups_only=whole)
        if self.schedule is not None:
            check_pipeline(ranks, self.schedule, self.collectives)

    def bind(
        self,
        *,
        timeout: timedelta | float = timedelta(minutes=5),
        device: torch.device | str | None = None,
        backend: str | None = None,
        seed: int | None = None,
    ) -> Runner:
        """Inside a torchrun worker: create the process groups and return this rank's Runner.

        `timeout` bounds every collective and group creation (a positive, finite number of
        seconds, or a timedelta): a peer that died makes the others fail with an error naming
        the group instead of hanging. `device` defaults to `cuda:LOCAL_RANK` when CUDA is
        available, else the CPU; `backend` to NCCL on CUDA devices and gloo otherwise.
        `seed` is the one every rank's dropout draws from (`fxpar.ops.random_streams`): by
        default rank 0's `torch.initial_seed()`, what the script gave `torch.manual_seed`.

        A program is bound once at a time: binding it again while its runner is live (or
        binding another program of the same model) is a BindError, since both runners would
        hook the same parameters; after `runner.close()` it may be bound again. Programs of
        different models may be live together (`fxpar.runtime.live_runners`). A parameter or
        buffer replaced on the model after compile is a BindError (`fxpar.frontend.replaced_state`).
        """
        from fxpar.runtime.runner import Runner

        check_state_not_replaced(self.captured)  # `model.fc.weight = nn.Parameter(...)` after compile
        return Runner.create(self, timeout=timeout, device=device, backend=backend, seed=seed)

    def __reduce__(self) -> tuple:
        return (_compile_again, (self.captured, self.plan, self.hardware, dict(self._edited)))

    def __repr__(self) -> str:
        params = self.captured.parameter_count()
        layout = (
            f"stages={len(self.stages)}" if self.stages else f"buckets={len(self.buckets)}"
        )
        return (
            f"Program(plan='{self.plan}', world_size={self.world_size}, parameters={params:,}, "
            f"{layout}, nodes={len(self.graph_module.graph.nodes)})"
        )

    def visualize(
        self,
        path: str | Path,
        *,
        rank: int | None = None,
        detail: Literal["module", "node"] = "module",
        expand: Sequence[str] = (),
    ) -> Path:
        """Draw the partitioned graph with graphviz to `path` (.svg, .png or .pdf): stages as
        clusters, every collective and transfer as its own box (`fxpar.pictures.visualize`)."""
        from fxpar.pictures.visualize import visualize

        return visualize(self, path, rank=rank, detail=detail, expand=expand)

    def report(self, path: str | Path, *, rank: int = 0, hardware: str = "h100") -> Path:
        """Write the one-page HTML report of this plan to `path` (`fxpar.tools.report`)."""
        from fxpar.tools.report import write_report

        return write_report(self, path, rank=rank, hardware=hardware)


def _compile_again(
    captured: CapturedGraph, plan: Plan, hardware: str, edited: dict[int, StepProgram]
) -> Program:
    """What `pickle.loads` calls for a Program (`Program.__reduce__`): compile again, and put
    back the step programs `replace_step_program` edited (they are data, and pickle as such)."""
    program = compile(captured, plan, hardware=hardware)
    for rank, step_program in edited.items():
        program.replace_step_program(rank, step_program)
    return program

