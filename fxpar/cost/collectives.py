"""Collective costs (ring algorithms) and the gradient-bucket size rule built on them.

Per rank, over n ranks and a payload of M bytes (nccl-tests PERFORMANCE.md "bus bandwidth"
factors):

    kind             steps      wire bytes per rank
    all_reduce       2(n-1)     2(n-1)/n x M
    reduce_scatter   n-1        (n-1)/n x M      (M: its input)
    all_gather       n-1        (n-1)/n x M      (M: its output)
    all_to_all       n-1        (n-1)/n x M      (M: its input; pairwise exchange; a routed
                                                  one's M under uniform routing)
    broadcast        n-1        M                (a pipelined chain)
    send / recv      1          M / 0            (point to point between pipeline stages)

Time is the alpha-beta model: alpha x steps + wire bytes / bandwidth, plus the link's wait
for the call's peers, once per call (`cost.hardware`'s module doc).
"""

from __future__ import annotations

import sympy

from fxpar.cost.hardware import Link

MiB = 2**20
DDP_DEFAULT_BUCKET_BYTES = 25 * MiB  # torch DDP's bucket_cap_mb default

_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1, "broadcast": 1, "send": 1,
          "recv": 1}


def wire_bytes(kind: str, payload: sympy.Expr | int, n: int) -> sympy.Expr:
    """Bytes each rank sends in a ring `kind` of `payload` bytes over `n` ranks."""
    if n == 1 or kind == "recv":
        return sympy.Integer(0)
    if kind in ("broadcast", "send"):
        return sympy.sympify(payload)
    return sympy.Rational(_STEPS[kind] * (n - 1), n) * payload


def collective_time(kind: str, payload: sympy.Expr | int, n: int, link: Link) -> sympy.Expr:
    """Seconds for one ring `kind`: the wait for its peers, latency steps, and its wire bytes
    at link speed."""
    if n == 1 or kind == "recv":  # a transfer is timed once, on the sending side
        return sympy.Integer(0)
    steps = _STEPS[kind] * (1 if kind == "send" else n - 1)
    wait = sympy.Float(link.wait) if link.wait else sympy.Integer(0)
    return wait + steps * sympy.Float(link.alpha) + wire_bytes(kind, payload, n) / sympy.Float(link.bandwidth)


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
    M = sympy.Symbol("M", positive=True)
    latency = collective_time("all_reduce", 0, n, link)
    (smallest,) = sympy.solve(sympy.Eq(latency, latency_share * collective_time("all_reduce", M, n, link)), M)
    return int(min(max(float(smallest), 1), DDP_DEFAULT_BUCKET_BYTES))
