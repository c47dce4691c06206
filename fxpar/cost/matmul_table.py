"""Matmul rates by shape: a table of measured (m, k, n) -> FLOP/s, and the seconds of any shape.

One efficiency for every matmul is wrong by up to 2x in both directions. On one H200 in bf16
a 16384 x 768 x 768 matmul runs at 378 TFLOP/s and an 8192^3 one at 769
(`shared/measurements/h200-2026-12-04`, part B); on one EPYC core in fp32, a 512^3 matmul at
98 GFLOP/s and the small GPT's linears, forward and backward, at 83 (`cost.calibrate`). And a
training step runs three matmuls per linear, each its own shape: for y = x W^T with x of
m x k and W of n x k, the forward is (m, k, n), the input's gradient dy W is (m, n, k) and the
weight's gradient x^T dy is (k, m, n) (torch computes its transpose dy^T x, the same work), a
long reduction over the m tokens into a small output, which runs at its own rate
(`matmul_shapes`).

A table holds the rates measured at some shapes; a shape between them gets a rate
interpolated in log space: log rate as a weighted mean of the measured points' log rates,
each weighted by the inverse square of its distance in (log m, log k, log n) (Shepard's
method), over the `NEIGHBOURS` nearest. A size beyond the measured ones is read as the
nearest measured (each of m, k, n clamped to the range measured): past the largest shapes a
matmul runs at their rate, not at a blend of all. It is exact at a measured shape, never
leaves the range of the measured rates, and needs no grid: the H200's ten shapes are scattered, the CPU's a grid. Written here rather
than taken from scipy (whose scattered interpolators are linear over a Delaunay
triangulation, undefined outside the measured shapes' hull, where most of a model's backward
shapes lie): a dozen lines of numpy, and no dependency for them.

`seconds(table, m, k, n)` is a sympy formula: unevaluated while a size is a symbol (the
batch), a number once every size is (`sympy.Function.eval`), so the estimate's formulas stay
formulas in batch and sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import sympy

NEIGHBOURS = 4  # measured shapes one interpolation reads


@dataclass(frozen=True)
class MatmulTable:
    """Measured matmul rates: `points` of (m, k, n, FLOP/s), 2 m k n FLOPs each."""

    points: tuple[tuple[float, float, float, float], ...]

    def __post_init__(self) -> None:
        if not self.points or any(len(p) != 4 or min(p) <= 0 for p in self.points):
            raise ValueError(f"a matmul table needs points (m, k, n, FLOP/s), all > 0; got {self.points!r}")

    @functools.cached_property
    def _log(self) -> tuple[np.ndarray, np.ndarray]:
        array = np.log2(np.asarray(self.points, dtype=np.float64))
        return array[:, :3], array[:, 3]

    def rate(self, m: float, k: float, n: float) -> float:
        """FLOP/s of an (m, k, n) matmul, interpolated (module doc)."""
        shapes, log_rates = self._log
        query = np.clip(np.log2([max(m, 1), max(k, 1), max(n, 1)]), shapes.min(axis=0), shapes.max(axis=0))
        distance = np.sqrt(((shapes - query) ** 2).sum(axis=1))
        nearest = np.argsort(distance)[:NEIGHBOURS]
        if distance[nearest[0]] == 0:
            return float(2 ** log_rates[nearest[0]])
        weights = 1 / distance[nearest] ** 2
        return float(2 ** (weights @ log_rates[nearest] / weights.sum()))

    def scaled(self, factor: float) -> MatmulTable:
        """The same table with every rate times `factor` (ranks sharing cores: `Hardware.shared_by`)."""
        return MatmulTable(tuple((m, k, n, rate * factor) for m, k, n, rate in self.points))


class _TableSeconds(sympy.Function):
    """Seconds of one (m, k, n) matmul at `table`'s rate: a number once m, k and n are."""

    table: MatmulTable  # set on the subclass `_seconds_function` makes for each table

    @classmethod
    def eval(cls, m, k, n):
        if m.is_number and k.is_number and n.is_number:
            m, k, n = float(m), float(k), float(n)
            return sympy.Float(2 * m * k * n / cls.table.rate(m, k, n)) if m * k * n else sympy.Integer(0)
        return None


@functools.cache
def _seconds_function(table: MatmulTable) -> type[_TableSeconds]:
    return type("matmul_seconds", (_TableSeconds,), {"table": table})


def seconds(table: MatmulTable, m, k, n) -> sympy.Expr:
    """Seconds of an (m, k, n) matmul at `table`'s interpolated rate, as a formula (module doc)."""
    return _seconds_function(table)(sympy.sympify(m), sympy.sympify(k), sympy.sympify(n))


def matmul_shapes(m, k, n) -> dict[str, tuple]:
    """The three matmuls a training step runs for a forward (m, k, n) matmul A B (A m x k, B
    k x n): its forward, A's gradient dC B^T (m, n, k), and B's gradient A^T dC (k, m, n), the
    weight's gradient of a linear, reducing over the m tokens."""
    return {"forward": (m, k, n), "input_gradient": (m, n, k), "weight_gradient": (k, m, n)}

