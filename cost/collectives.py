"""Collective costs (ring algorithms) and the gradient-bucket size rule built on them.

Per rank, a ring all-reduce of a payload of M bytes over n ranks takes 2(n-1) steps and
moves 2(n-1)/n x M bytes; reduce-scatter and all-gather take n-1 steps and move (n-1)/n x M
(nccl-tests PERFORMANCE.md, "bus bandwidth" factors). Time is alpha x steps + wire / bandwidth.
"""

from __future__ import annotations

import sympy

from fxpar.cost.hardware import Link

MiB = 2**20
DDP_DEFAULT_BUCKET_BYTES = 25 * MiB  # torch DDP's bucket_cap_mb default


def all_reduce_wire_bytes(payload: sympy.Expr | int, n: int) -> sympy.Expr:
    """Bytes each rank sends in a ring all-reduce of `payload` bytes over `n` ranks."""
    return sympy.Rational(2 * (n - 1), n) * payload


def all_reduce_time(payload: sympy.Expr | int, n: int, link: Link) -> sympy.Expr:
    """Seconds for a ring all-reduce: 2(n-1) latency steps plus its wire bytes at link speed."""
    if n == 1:
        return sympy.Integer(0)
    return 2 * (n - 1) * sympy.Float(link.alpha) + all_reduce_wire_bytes(payload, n) / sympy.Float(
        link.bandwidth
    )


def gradient_bucket_bytes(n: int, link: Link, *, latency_share: float = 0.1) -> int:
    """The smallest bucket whose all-reduce spends at most `latency_share` of its time in latency.

    Buckets trade latency against overlap: one all-reduce per gradient pays 2(n-1) alpha each
    time; one bucket for the whole model cannot start before backward ends. The rule takes the
    smallest payload M with 2(n-1) alpha <= share x time(M), which solves to
    M >= n alpha bandwidth (1 - share) / share, capped at DDP's 25 MiB, beyond which the
    latency is already negligible and overlap only shrinks (Li et al. 2020, Fig. 7).
    """
    if n <= 1:
        return DDP_DEFAULT_BUCKET_BYTES
    smallest = n * link.alpha * link.bandwidth * (1 - latency_share) / latency_share
    return int(min(max(smallest, 1), DDP_DEFAULT_BUCKET_BYTES))
