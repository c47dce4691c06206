"""Hardware profiles: the constants the cost formulas are evaluated with.

A device is described by its peak dense matmul rate per precision (datasheets, as in
torchtitan's `get_peak_flops`), the fraction of it large matmuls reach in practice, and its
memory bandwidth. A link follows the alpha-beta model (Hockney 1994; the form of nccl-tests'
PERFORMANCE.md): one hop of n bytes costs `alpha + n / bandwidth` seconds. GPU link numbers
are FORMULAS.md's (about 370 GB/s ring bus bandwidth on 8x H100/H200 NVLink, nccl-tests
issues #212 and #272).

The `cpu` profile is measured on the running machine (`fxpar.cost.calibrate`) and cached;
`hardware_profile("cpu", measured=False)` gives fixed nominal numbers instead, for decisions
that every rank must take identically (gradient-bucket sizes at compile time).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Link:
    """One hop of a collective: `alpha` seconds of latency, `bandwidth` bytes per second."""

    alpha: float
    bandwidth: float


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense matmul FLOP/s of one device, by math precision
    matmul_efficiency: float  # share of peak that large matmuls reach
    memory_bandwidth: float  # bytes/s a large device copy reaches
    intra_node: Link  # between devices of one node (NVLink, or loopback for CPU processes)
    inter_node: Link  # between nodes (InfiniBand / Ethernet)
    devices_per_node: int
    measured: dict[str, float] = field(default_factory=dict)  # raw calibration readings

    def matmul_rate(self, precision: str) -> float:
        """FLOP/s a large matmul reaches in `precision` ("fp32" or "bf16")."""
        return self.peak_flops[precision] * self.matmul_efficiency

    def link(self, ranks: tuple[int, ...]) -> Link:
        """The slowest link a collective over `ranks` crosses."""
        nodes = {r // self.devices_per_node for r in ranks}
        return self.intra_node if len(nodes) == 1 else self.inter_node


PROFILES: dict[str, Hardware] = {
    "a100": Hardware(
        name="a100",  # A100 SXM 80GB
        peak_flops={"bf16": 312e12, "fp32": 19.5e12},
        matmul_efficiency=0.8,
        memory_bandwidth=0.9 * 2.039e12,
        intra_node=Link(alpha=8e-6, bandwidth=230e9),
        inter_node=Link(alpha=15e-6, bandwidth=25e9),  # 200 Gb/s HDR InfiniBand per GPU
        devices_per_node=8,
    ),
    "h100": Hardware(
        name="h100",  # H100 SXM
        peak_flops={"bf16": 989e12, "fp32": 67e12},
        matmul_efficiency=0.8,
        memory_bandwidth=0.9 * 3.35e12,
        intra_node=Link(alpha=6e-6, bandwidth=370e9),
        inter_node=Link(alpha=12e-6, bandwidth=50e9),  # 400 Gb/s NDR InfiniBand per GPU
        devices_per_node=8,
    ),
    "h200": Hardware(
        name="h200",
        peak_flops={"bf16": 989e12, "fp32": 67e12},
        matmul_efficiency=790 / 989,  # measured here: 8192^3 bf16 matmul (FORMULAS.md)
        memory_bandwidth=4.3e12,  # measured here: device copy (FORMULAS.md)
        intra_node=Link(alpha=6e-6, bandwidth=370e9),
        inter_node=Link(alpha=12e-6, bandwidth=50e9),
        devices_per_node=8,
    ),
}

NOMINAL_CPU = Hardware(
    name="cpu",
    peak_flops={"fp32": 5e10, "bf16": 5e10},
    matmul_efficiency=1.0,
    memory_bandwidth=5e9,
    intra_node=Link(alpha=50e-6, bandwidth=2e9),  # gloo over loopback TCP
    inter_node=Link(alpha=100e-6, bandwidth=1.25e9),  # 10 GbE
    devices_per_node=1024,  # CPU processes of one machine: all "intra-node"
)

KNOWN = ("cpu", *PROFILES)


def hardware_profile(name: str, *, measured: bool = True) -> Hardware:
    """The profile called `name`; a ValueError lists the known ones.

    "cpu" is measured on this machine (a few seconds once, then cached on disk) unless
    `measured=False`, which returns nominal constants.
    """
    if name == "cpu":
        if not measured:
            return NOMINAL_CPU
        from fxpar.cost.calibrate import measure_cpu

        return measure_cpu()
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known profiles: {', '.join(KNOWN)}") from None
