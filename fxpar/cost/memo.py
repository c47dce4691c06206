"""Cost terms memoised beside the graph they describe, never on a Program.

Summing the op rules over a graph or tracing its saved activations takes seconds on a large
model, and every estimate of every plan compiled from one capture needs the same sums. They
are kept per GraphModule, weakly: gone with the graph, and shared by the programs that share
it (all plans of one `fxpar.capture` share its graph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar
from weakref import WeakKeyDictionary

import torch.fx as fx

T = TypeVar("T")
_TERMS: WeakKeyDictionary[fx.GraphModule, dict[str, object]] = WeakKeyDictionary()


def memoised(graph_module: fx.GraphModule, term: str, compute: Callable[[], T]) -> T:
    """`compute()` the first time `term` is asked of `graph_module`, the same value after."""
    terms = _TERMS.setdefault(graph_module, {})
    if term not in terms:
        terms[term] = compute()
    return terms[term]  # type: ignore[return-value]
