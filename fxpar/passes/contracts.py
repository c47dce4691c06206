"""Pass contracts, checked: what each pass promises about the graph it returns.

Every pass documents *Requires* and *Ensures*; `ensures(check)` attaches the Ensures half as
code, and `passes.infra.run_passes` runs it after the pass when checking is on: always in
the tests (tests/conftest.py sets `FXPAR_CHECK_PASSES=1`, which torchrun workers inherit),
and for a user behind that same environment variable. A broken promise is an fxpar bug, so it
raises `ContractError` naming the pass, the promise and the first node that breaks it.

    def every_tensor_placed(gm): ...          # raises broken("...", node)

    @ensures(every_tensor_placed)
    def shard_tensor_parallel(gm, ...): ...

Each check lives next to its pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.fx as fx

from fxpar.ir import meta

Check = Callable[[fx.GraphModule], None]


class ContractError(AssertionError):
    """A pass returned a graph that breaks its own written contract."""


def checking() -> bool:
    """Whether run_passes checks contracts: FXPAR_CHECK_PASSES=1 in the environment."""
    return os.environ.get("FXPAR_CHECK_PASSES", "") not in ("", "0")


def ensures(*checks: Check):
    """Attach `checks` to a pass as its Ensures, for run_passes to run after it."""

    def attach(graph_pass):
        graph_pass.ensures = checks
        return graph_pass

    return attach


def broken(promise: str, node: fx.Node | None = None) -> ContractError:
    """The error for a broken `promise`, at `node` when one is to blame."""
    where = f": {meta.describe(node)}" if node is not None else ""
    return ContractError(f"{promise}{where}")
