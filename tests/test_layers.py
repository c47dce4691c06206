"""The layers of fxpar import in one direction, and no module imports itself back.

    core     plan, mesh, placement, meta, the distributed ops and their table, capture,
             schedules and the simulator: facts about the job, no policy
    cost     fxpar.cost: formulas over graphs and step programs, taken as data
    passes   fxpar.passes: graph rewrites, which may price with cost
    program  compile, Program, the pipeline program and the lowering to step programs
    runtime  fxpar.runtime: one torchrun worker
    tools    what reads a compiled program for people: pictures, charts, the report, the plan
             diff, the command line

A module may import its own layer and those below it. Every import counts: module level,
inside functions and under `if TYPE_CHECKING:` (a type-only import is still a dependency a
reader must follow, and the cycles it hides are the ones that break refactors). The one
upward edge is the entry point `Program.bind`, a function-level import of the runner, kept
acyclic because nothing in the runtime imports the program module. `Program.visualize` and
`Program.report` are the same kind of entry point into the tools layer, acyclic because the
tools take the program as data (`CompiledProgram`) and never import the program module back;
only the command line, which nothing imports, calls `compile`.
"""

import ast
from pathlib import Path

LAYERS = ("core", "cost", "passes", "program", "runtime", "tools")
PROGRAM = {"fxpar.program", "fxpar.lowering", "fxpar.reduction_lowering", "fxpar.full_state_lowering",
           "fxpar.compilation", "fxpar.rank_specialisation", "fxpar.pass_list", "fxpar.pipeline_program"}
TOOLS = {
    "fxpar.payloads", "fxpar.picture_units", "fxpar.picture_transfers", "fxpar.picture_boxes",
    "fxpar.picture", "fxpar.visualize", "fxpar.rank_memory", "fxpar.charts", "fxpar.plan_diff",
    "fxpar.report", "fxpar.model_loading", "fxpar.explain", "fxpar.cli", "fxpar.__main__",
    "fxpar.verify", "fxpar.verify_values", "fxpar.verify_report",
}
ALLOWED_UPWARD = {  # function-level entry points
    ("fxpar.program", "fxpar.runtime.runner"),  # Program.bind
    ("fxpar.program", "fxpar.visualize"),  # Program.visualize
    ("fxpar.program", "fxpar.report"),  # Program.report
}


def layer(module: str) -> str:
    for prefix in ("fxpar.cost", "fxpar.passes", "fxpar.runtime"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix.split(".")[1]
    if module in TOOLS:
        return "tools"
    return "program" if module in PROGRAM else "core"


def modules() -> dict[str, Path]:
    """Every module of the package (fxpar.passes and fxpar.cost live in top-level folders)."""
    found = {}
    for package in ("fxpar", "fxpar.passes", "fxpar.cost", "fxpar.runtime"):
        folder = Path(__import__(package, fromlist=["_"]).__file__).parent
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The fxpar modules `path` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in known else node.module for n in names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) for name, path in found.items()}


def test_the_graph_is_read_from_every_module():
    edges = graph()
    assert {"fxpar.program", "fxpar.passes.tensor_parallel", "fxpar.cost.estimate",
            "fxpar.runtime.runner", "fxpar.distributed_ops"} <= set(edges)
    assert "fxpar.distributed_ops" in edges["fxpar.redistribution"]
    assert TOOLS <= set(edges), f"TOOLS names modules that do not exist: {sorted(TOOLS - set(edges))}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, targets in graph().items():
        if module == "fxpar":
            continue  # the package's public face imports what it re-exports
        for target in targets:
            if target == "fxpar" or LAYERS.index(layer(target)) > LAYERS.index(layer(module)):
                if (module, target) not in ALLOWED_UPWARD:
                    upward.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = {m: t for m, t in graph().items() if m != "fxpar"}
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)

