"""The layers of fxpar import in one direction, and no module imports itself back.

A module's layer is its folder's: `LAYERS` is the one list, bottom to top, of which folders
make each layer, and `docs/architecture.md`'s layer map is checked against it below.

A module may import its own layer and those below it. Every import counts: module level,
inside functions and under `if TYPE_CHECKING:` (a type-only import is still a dependency a
reader must follow, and the cycles it hides are the ones that break refactors). The upward
edges are entry points, function-level imports kept acyclic because nothing they reach imports
the module back: `Program.bind` into the runtime, `Program.visualize` and `Program.report`
into the tools (which take the program as data, `ir.compiled_program.CompiledProgram`).
"""

import ast
import re
from pathlib import Path

import fxpar

PACKAGE = Path(fxpar.__file__).parent
REPO = PACKAGE.parent
LAYERS = (  # bottom to top: (layer, the folders under fxpar/ that make it)
    ("core", ("ir", "plan", "frontend", "ops", "schedule", "errors.py")),
    ("cost", ("cost",)),
    ("passes", ("passes",)),
    ("program", ("compiler", "planner")),
    ("runtime", ("runtime",)),
    ("tools", ("pictures", "tools", "__main__.py")),
)
ALLOWED_UPWARD = {  # function-level entry points
    ("fxpar.compiler.program", "fxpar.runtime.runner"),  # Program.bind
    ("fxpar.compiler.program", "fxpar.pictures.visualize"),  # Program.visualize
    ("fxpar.compiler.program", "fxpar.tools.report"),  # Program.report
}
MOST_MODULES_PER_FOLDER = 20
RANKS = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def layer(module: str) -> str:
    """The layer of a module, read from the first folder (or file) under fxpar/ it lives in."""
    top = module.split(".")[1]
    for name, folders in LAYERS:
        if top in folders or f"{top}.py" in folders:
            return name
    raise AssertionError(f"{module} lives in fxpar/{top}, which no layer of LAYERS names")


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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
    assert {"fxpar.compiler.program", "fxpar.passes.tensor_parallel.rewrite", "fxpar.cost.estimate",
            "fxpar.runtime.runner", "fxpar.ops.distributed"} <= set(edges)
    assert "fxpar.ops.distributed" in edges["fxpar.ops.redistribution"]


def test_every_module_lives_in_a_layer_and_no_folder_is_crowded():
    assert {layer(module) for module in modules() if module != "fxpar"} == {name for name, _ in LAYERS}
    folders: dict[Path, int] = {}
    for path in modules().values():
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(f.relative_to(REPO)): n for f, n in folders.items() if n > MOST_MODULES_PER_FOLDER}
    assert not crowded, f"folders over {MOST_MODULES_PER_FOLDER} modules: {crowded}"


def test_the_architecture_page_lists_the_layers_as_this_test_does():
    """docs/architecture.md's layer map is a table, one row per layer: `| **layer** | folders |`."""
    page = (REPO / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| \*\*(\w+)\*\* \| (.+?) \|", page, re.M)
    written = [(name, tuple(re.findall(r"`fxpar/([\w.]+?)/?`", folders))) for name, folders in rows]
    assert written == list(LAYERS), f"docs/architecture.md's layer map {written} != tests/test_layers.py's {LAYERS}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, targets in graph().items():
        if module == "fxpar":
            continue  # the package's public face imports what it re-exports
        for target in targets:
            if target == "fxpar" or RANKS[layer(target)] > RANKS[layer(module)]:
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

