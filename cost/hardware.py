"""Hardware profiles: the constants the cost formulas are evaluated with.

A link is described by the alpha-beta model (Hockney 1994; the form NCCL's own tuning model
and nccl-tests' PERFORMANCE.md use): sending one message of `n` bytes over one hop costs
`alpha + n / bandwidth` seconds. Numbers for GPU links come from FORMULAS.md (nccl-tests
issues #212 and #272: about 370 GB/s ring bus bandwidth on 8x H100/H200 NVLink); the CPU
gloo link is a conservative loopback-TCP figure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Link:
    """One hop of a collective: `alpha` seconds of latency, `bandwidth` bytes per second."""

    alpha: float
    bandwidth: float


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s of one device (datasheet)
    intra_node: Link  # between devices of one node (NVLink, or loopback for CPU processes)
    inter_node: Link  # between nodes (InfiniBand / Ethernet)
    devices_per_node: int


PROFILES: dict[str, Hardware] = {
    "cpu": Hardware(
        name="cpu",
        peak_flops=1e11,
        intra_node=Link(alpha=50e-6, bandwidth=2e9),  # gloo over loopback TCP
        inter_node=Link(alpha=100e-6, bandwidth=1.25e9),  # 10 GbE
        devices_per_node=2,
    ),
    "a100": Hardware(
        name="a100",
        peak_flops=312e12,
        intra_node=Link(alpha=8e-6, bandwidth=230e9),
        inter_node=Link(alpha=15e-6, bandwidth=25e9),  # 200 Gb/s HDR InfiniBand per GPU
        devices_per_node=8,
    ),
    "h100": Hardware(
        name="h100",
        peak_flops=989e12,
        intra_node=Link(alpha=6e-6, bandwidth=370e9),
        inter_node=Link(alpha=12e-6, bandwidth=50e9),  # 400 Gb/s NDR InfiniBand per GPU
        devices_per_node=8,
    ),
    "h200": Hardware(
        name="h200",
        peak_flops=989e12,
        intra_node=Link(alpha=6e-6, bandwidth=370e9),
        inter_node=Link(alpha=12e-6, bandwidth=50e9),
        devices_per_node=8,
    ),
}


def hardware_profile(name: str) -> Hardware:
    """The profile called `name`; a ValueError lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware {name!r}; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None
