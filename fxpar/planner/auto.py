"""`plan="auto"` for one capture: its search space, its memory bound, and each candidate priced
by the program's own estimate.

One capture serves every candidate: each is compiled from it (`compile(captured, plan)`, no
second `torch.export`) and priced by `program.estimate()`, the same numbers `fxpar estimate`
prints for that plan, so the ranking is never a second cost model that can disagree with the
first. The compile function is passed in by `fxpar.compiler.program`, which owns it.

The hardware profile is resolved once for the whole search. "cpu" is measured on this machine
(as `program.estimate("cpu")` is) unless `measured=False`, which `compile(model, "auto")`
passes: under torchrun every rank runs the search for itself, and only constants every rank
shares make them all choose the same plan (as gradient-bucket sizes, `cost.profiles`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping

from fxpar.cost.hardware import Hardware
from fxpar.cost.memory import model_state_bytes
from fxpar.cost.profiles import hardware_profile
from fxpar.frontend.trace import CapturedGraph
from fxpar.ir import meta
from fxpar.ops.expert_routing import is_grouped_mm
from fxpar.plan.plan import Plan
from fxpar.planner.budget import memory_budget
from fxpar.planner.search import PlanSearch, Scored, search
from fxpar.planner.space import SearchSpace


def search_plans(
    captured: CapturedGraph,
    *,
    compile_plan: Callable[..., object],
    world_size: int,
    hardware: str,
    memory_per_device: float | str | None = None,
    devices_per_node: int | None = None,
    fixed: str | Mapping[str, object] | None = None,
    optimizer: str = "adamw",
    measured: bool = True,
) -> PlanSearch:
    """Search every plan of `world_size` ranks for `captured` (module doc, `planner.search`)."""
    device = hardware_profile(hardware, measured=measured)
    seq = captured.symbols.get("seq")
    space = SearchSpace(world_size=world_size, devices_per_node=devices_per_node or device.devices_per_node,
                        batch=captured.example_batch, fixed=Plan.fields_given(fixed) if fixed else {},
                        sequence=captured.example_sizes[seq] if seq is not None else None)
    experts, expert_parameters = mixture_of_experts(captured)
    space = dataclasses.replace(space, experts=experts)
    parameters = captured.parameter_count()

    def bound(plan: Plan) -> float:
        """Bytes the worst rank holds at least: its weights and optimizer state, for at least
        an even share of the parameters (tp and pp split no parameter more finely, ep an
        expert's; cp replicates them)."""
        held = parameters - expert_parameters * (1 - 1 / plan.ep)
        state = model_state_bytes(held / (plan.tp * plan.pp), precision=plan.precision,
                                  optimizer=optimizer, zero=plan.zero, dp=plan.dp,
                                  reduce_dtype=plan.reduce_dtype)
        return float(state["params"] + state["optimizer"])

    def evaluate(plan: Plan) -> Scored:
        return priced(compile_plan, captured, plan, hardware=hardware, device=device, optimizer=optimizer)

    # Compiled mode, where it pays (`Hardware.compile_pays`) and the caller left it open: the
    # fastest plans compiled by Inductor, priced by the kernels it runs (`cost.fused_kernels`).
    compiled = device.compile_pays and "compile" not in space.fixed
    return search(space, hardware=device.name, budget_bytes=memory_budget(memory_per_device, world_size=world_size),
                  bound=bound, evaluate=evaluate, variant=compiled_variant if compiled else None)


def mixture_of_experts(captured: CapturedGraph) -> tuple[int | None, int]:
    """The experts of each mixture-of-experts layer (the fewest, where layers differ) and the
    elements of all expert weights: what `ep` may split (`passes.expert_parallel`); (None, 0)
    for a model without a grouped matmul over experts."""
    graph_module = captured.graph_module
    matmuls = [n for n in graph_module.graph.nodes if is_grouped_mm(n)]
    if not matmuls:
        return None, 0
    weights = {meta.parameter_name(w) for w in (_viewed(m.args[1]) for m in matmuls) if meta.parameter_name(w)}
    experts = min(int(m.args[1].meta["val"].shape[0]) for m in matmuls)
    return experts, sum(graph_module.get_parameter(name).numel() for name in weights)


def _viewed(node):
    """What a chain of single-input views (the expert weights' transpose) reads."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node


def compiled_variant(plan: Plan) -> Plan:
    """`plan` under `compile=inductor`; the plan's PlanError where compiled mode does not
    cover it (`plan.combinations.check_compiled`)."""
    return dataclasses.replace(plan, compile="inductor")


def priced(compile_plan, captured: CapturedGraph, plan: Plan, *, hardware: str, device: Hardware,
           optimizer: str) -> Scored:
    """`plan` compiled from `captured` and estimated on `device`. Compile's warnings (a mean
    loss over unequal pieces, ...) are the chosen plan's to give when it is compiled for real,
    not every candidate's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = compile_plan(captured, plan, hardware=hardware, check=False)
    estimate = program.estimate(hardware=device, optimizer=optimizer)
    return Scored(plan=plan, seconds=estimate.time["total"], peak_bytes=estimate.memory["total"], estimate=estimate)
