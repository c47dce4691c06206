"""Cost terms memoised beside the graph they describe, never on a Program.

Summing the op rules over a graph or tracing its saved activations takes seconds on a large
model, and every estimate of every plan compiled from one capture needs the same sums. They
are kept per GraphModule, weakly: gone with the graph, and shared by the programs that share
it (all plans of one `fxpar.capture` share its graph).

Rank modules are new GraphModules in every program, yet many plans give a rank the same module
(dp=2 and dp=4, ZeRO-1 and 2, every schedule and microbatch count of one cut): `module_key`
names what a fake forward of a module reads, so that the planner's hundreds of programs trace
each distinct module once (memoised beside the capture's graph).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from typing import TypeVar
from weakref import WeakKeyDictionary

import torch
import torch.fx as fx

from fxpar.ir import meta

T = TypeVar("T")
_TERMS: WeakKeyDictionary[fx.GraphModule, dict[str, object]] = WeakKeyDictionary()


def memoised(graph_module: fx.GraphModule, term: str, compute: Callable[[], T]) -> T:
    """`compute()` the first time `term` is asked of `graph_module`, the same value after."""
    terms = _TERMS.setdefault(graph_module, {})
    if term not in terms:
        terms[term] = compute()
    return terms[term]  # type: ignore[return-value]


def module_key(module: fx.GraphModule, *extra: object) -> str:
    """A digest of everything a fake forward of `module` reads: its code, each node's
    recompute region and gradient flag, the shape and dtype of each placeholder's value and of
    each state tensor it reads (with the dtype the graph computes it in), and `extra`."""
    parts: list[object] = [module.code, extra]
    for node in module.graph.nodes:
        value = node.meta.get("val")
        described = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
        parts.append((node.name, meta.recompute_region(node), meta.requires_grad(node), described))
        if node.op == "get_attr":
            state = operator.attrgetter(node.target)(module)
            if isinstance(state, torch.Tensor):
                parts.append((tuple(state.shape), tuple(state.stride()), state.dtype, state.requires_grad))
    return hashlib.sha1(repr(parts).encode()).hexdigest()
