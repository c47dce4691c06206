"""The symbols of every cost formula, declared once.

Sizes that vary from step to step stay symbolic: `batch` (the global batch, in sequences)
and `seq` (the sequence length) are the names `fxpar.frontend.trace` gives export's dynamic dims, so
a FLOP count read off the captured graph is already a formula in them. Everything else
(plan degrees, hardware constants) is a number by the time a formula is shown.
"""

from __future__ import annotations

import sympy

BATCH = sympy.Symbol("batch", integer=True, positive=True)
SEQ = sympy.Symbol("seq", integer=True, positive=True)


def dim_symbol(name: str) -> sympy.Symbol:
    """The symbol of a dynamic input dim: `batch`, `seq`, or another positive integer."""
    return sympy.Symbol(name, integer=True, positive=True)
