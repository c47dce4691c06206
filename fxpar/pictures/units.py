"""Which drawn box each graph node belongs to: the grouping behind `program.visualize`.

A picture at `detail="module"` draws one box per module *unit* instead of one per aten node:

    module path of a node        its unit           why
    h.3.attn.q                   h.3                the first indexed child: one block
    model.layers.3.mlp.up_proj   model.layers.3     (a ModuleList item) is one box
    bert.embeddings.LayerNorm    bert.embeddings    no index: the first two names
    wte                          wte
    "" (the root module)         top-level ops #k   consecutive root ops, one box per run

so a 48-layer GPT is about 55 boxes. A unit is also split by pipeline stage: a block the cut
runs through is drawn in both stages' clusters. Collectives (`torch.ops.fxpar` ops), inputs
and the output always keep a box of their own; parameters are folded into the module that
reads them (drawn as boxes at `detail="node"`); shape arithmetic (SymInt nodes) and, with a
pipeline, the cheap tensors every stage recomputes (positions from `arange`) are left out.
`expand=["h.3"]` draws the nodes of `h.3` (and of the modules under it) one by one, inside a
cluster of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ops.distributed import distributed_op

Detail = Literal["module", "node"]
UnitKind = Literal["input", "module", "node", "parameter", "collective", "output"]


@dataclass(frozen=True)
class Unit:
    """One box's identity: what it is, its name, and the pipeline stage it is drawn in."""

    kind: UnitKind
    name: str  # module unit path, node name, input or parameter name
    stage: int | None = None
    expanded: str | None = None  # the expanded module it is drawn inside, at node detail


def module_unit(path: str) -> str:
    """The collapsed box of a module path (see module doc): "h.3.attn.q" -> "h.3"."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def check_expand(graph: fx.Graph, expand: Sequence[str]) -> None:
    """Raise ValueError for an `expand` entry that names no module of the graph."""
    paths = sorted({meta.module_path(n) for n in graph.nodes if meta.module_path(n)})
    for name in expand:
        if not any(p == name or p.startswith(name + ".") for p in paths):
            units = sorted({module_unit(p) for p in paths}, key=_natural)[:8]
            raise ValueError(
                f"expand={name!r} names no module of the graph. Module boxes are named like: "
                f"{', '.join(units)}. Fix: expand one of those, or a module path under one"
            )


def assign_units(
    graph: fx.Graph, *, detail: Detail, expand: Sequence[str], pipelined: bool
) -> dict[fx.Node, Unit]:
    """Every drawn node -> its Unit, in graph order; nodes left out are absent."""
    units: dict[fx.Node, Unit] = {}
    run, last_root = 0, False  # root runs: see the module doc
    for node in graph.nodes:
        stage = node.meta.get(meta.STAGE)
        if node.op == "placeholder":
            if isinstance(node.meta.get("val"), torch.Tensor):
                units[node] = Unit("input", node.name)
            continue
        if node.op == "output":
            units[node] = Unit("output", "output")
            continue
        if node.op == "get_attr":
            owner = _expanded_owner(_parameter_module(node), expand)
            if detail == "node" or owner is not None:
                units[node] = Unit("parameter", meta.parameter_name(node) or node.name, None, owner)
            continue
        if node.op != "call_function" or not _is_tensor_value(node):
            continue  # shape arithmetic
        if pipelined and stage is None:
            continue  # recomputed by every stage that reads it (passes.pipeline._replicable)
        path = meta.module_path(node)
        owner = _expanded_owner(path, expand)
        if distributed_op(node) is not None:
            units[node] = Unit("collective", node.name, stage, owner)
            continue  # a collective inside a run of root ops does not end the run
        if detail == "node" or owner is not None:
            units[node] = Unit("node", node.name, stage, owner)
        elif path:
            units[node] = Unit("module", module_unit(path), stage)
        else:  # the root module's own ops: one box per consecutive run
            run += not last_root
            units[node] = Unit("module", f"top-level ops #{run}", stage)
        last_root = not path and units[node].kind == "module"
    return units


def _parameter_module(node: fx.Node) -> str:
    name = meta.parameter_name(node) or str(node.target)
    return name.rpartition(".")[0]


def _expanded_owner(path: str, expand: Sequence[str]) -> str | None:
    """The longest `expand` entry that `path` lies in, else None."""
    owners = [e for e in expand if path == e or path.startswith(e + ".")]
    return max(owners, key=len) if owners else None


def _is_tensor_value(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def _natural(path: str) -> list:
    """Sort key that puts h.2 before h.10."""
    return [int(p) if p.isdigit() else p for p in path.split(".")]
