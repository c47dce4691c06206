"""Running passes: one printable list, a lint and a node-count log after each.

A pass is a function `(gm: GraphModule) -> GraphModule` with a written contract in its
docstring (*Requires*: the `node.meta` keys it reads; *Ensures*: what holds afterwards).
Options are bound with `functools.partial`, as torchtitan's graph_trainer does:

    passes = [partial(assign_gradient_buckets, bucket_bytes=25 * 2**20)]
    gm = run_passes(captured.graph_module, passes)

`run_passes` works on a copy of the graph (the captured graph stays as it was, and the copy
still shares parameter tensors), lints the graph after every pass, logs each pass' time and
node-count change at DEBUG level, and reports which pass failed after which.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch.fx as fx

from fxpar.frontend.trace import restore_state_layout
from fxpar.passes.contracts import checking

log = logging.getLogger("fxpar.passes")

GraphPass = Callable[[fx.GraphModule], fx.GraphModule]


def pass_name(graph_pass: GraphPass) -> str:
    """`assign_gradient_buckets(bucket_bytes=1048576)` for a partial, the name otherwise."""
    if isinstance(graph_pass, partial):
        options = ", ".join(f"{k}={_short(v)}" for k, v in graph_pass.keywords.items())
        return f"{pass_name(graph_pass.func)}({options})"
    return getattr(graph_pass, "__name__", repr(graph_pass))


def _short(value: object, limit: int = 60) -> str:
    """An option's repr, cut to `limit` characters: a placement table of a 96-layer model
    must not make every error note megabytes long."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} entries)" if hasattr(value, "__len__") else ""
    return f"{text[:limit - 3]}...{size}"


def _function(graph_pass: GraphPass):
    return _function(graph_pass.func) if isinstance(graph_pass, partial) else graph_pass


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of `gm`'s graph and meta, sharing its parameter tensors."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta = copy.copy(gm.meta)
    restore_state_layout(new)
    return new


def run_passes(gm: fx.GraphModule, passes: Sequence[GraphPass]) -> fx.GraphModule:
    """Apply `passes` in order to a copy of `gm`; see the module docstring."""
    gm = copy_graph_module(gm)
    done: list[str] = []
    for graph_pass in passes:
        name = pass_name(graph_pass)
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        try:
            gm = graph_pass(gm)
            gm.graph.lint()
            if checking():
                for check in getattr(_function(graph_pass), "ensures", ()):
                    check(gm)
        except Exception as error:
            after = f"after {', '.join(done)}" if done else "as the first pass"
            error.add_note(f"fxpar: pass {name} failed ({after})")
            raise
        log.debug(
            "%s: %.1f ms, %d -> %d nodes",
            name, 1e3 * (time.perf_counter() - start), before, len(gm.graph.nodes),
        )
        done.append(name)
    gm.recompile()  # once: passes read and write the graph, never the generated code
    return gm
