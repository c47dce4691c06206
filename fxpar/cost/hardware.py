"""Hardware profiles: the constants the cost formulas are evaluated with.

A device is described by its peak dense matmul rate per precision (datasheets, as in
torchtitan's `get_peak_flops`), the fraction of it large matmuls reach in practice, and its
memory bandwidth; where measured, by its matmul rates by shape (`matmul_tables`, one
`cost.matmul_table.MatmulTable` per precision: each matmul of the forward and the backward
priced at its own shape's rate instead of one efficiency); then by what a step pays besides
FLOPs and bytes:

* `attention_efficiency`: attention (forward + backward, FLOPs counted as in `cost.ops`)
  runs at this share of the matmul rate. GPU default 0.6: FlashAttention-2 reaches 50-73% of
  the A100's peak (Dao 2023, abstract), below what large matmuls reach (0.8 here). Measured
  on the CPU: 0.40-0.65 of the matmul rate, depending on the head dim (`cost.calibrate`);
* `elementwise_efficiency`: the share of memory bandwidth that the other ops (elementwise,
  norms, softmax, losses) reach over forward and backward, their bytes counted as `cost.ops`
  counts them; `bandwidths`, where a profile measured them, the bytes/s of each class of
  those ops instead (`cost.ops.BYTE_KINDS`: pointwise, activation, norm, loss, copy). GPU default 1
  (bytes at full bandwidth; the measured h200 and cpu profiles have their own per class but
  copies). Measured on the CPU: 0.3-0.5; the exact GELU and softmax are compute-bound there,
  and backward runs ops the forward graph does not show (bias-gradient sums, gradient fills,
  copies of transposes);
* `op_overhead`: seconds each op pays besides its FLOPs and bytes (dispatch, autograd
  bookkeeping, on a GPU the kernel launch), added to them, per op as `cost.ops.op_counts`
  counts them (on the CPU 9 us, measured on a transformer block: `cost.calibrate`). GPU
  default 5 us, the order of a CUDA launch seen from Python; as a GPU launches while earlier
  kernels run, adding it is pessimistic there unless the ops are tiny;
* `kernel_launch` and `fused_bandwidth`: under `compile=inductor` a rank's graphs run as
  Inductor's kernels (`cost.fused_kernels`), with no autograd or dispatcher between them: each
  kernel pays `kernel_launch` (default 5 us, the order of a launch from Inductor's Python
  wrapper) instead of `op_overhead`, and each fused kernel streams its bytes at
  `fused_bandwidth`, by default the copy bandwidth (`memory_bandwidth`): a fused kernel reads
  its inputs and writes its outputs once, as a copy does. Neither is measured yet (on the
  CPU a compiled step of the small GPT took what an eager one did, 53 ms, where the estimate
  priced both alike: RESULTS.md). Each call of a compiled graph, forward or backward, also
  pays `compiled_call` on the host (Dynamo's guards, AOTAutograd's wrapper and its autograd
  node): on this project's CPU a forward and backward of a compiled two-op graph took 209 us
  against 52 us eager, so about 80 us a call; it counts where a step makes many calls (a
  zero-bubble stage, compiled between its linears: `runtime.compiled_segments`);
* `compile_pays`: whether Inductor's kernels run a step faster than eager ops on this device,
  so that the planner prices `compile=inductor` variants of its fastest plans
  (`planner.search`). True by default: on an H200 torch.compile of GPT-2 124M ran 35.5 ms a
  step against eager's 51.7 (shared/measurements/h200-2026-12-04). False for the CPU: a
  compiled step of the small GPT took what an eager one did (53.5 against 54.1 ms,
  RESULTS.md), compiling takes minutes, and it needs a C++ compiler;
* `host_overlap`: whether the device runs its kernels while the host dispatches the next
  ops (a GPU, asynchronous), so that a phase takes the longer of its kernels and its
  per-op overhead rather than their sum (a CPU, which does both on the same cores). False
  in the nominal profiles, which add them (pessimistic unless the ops are tiny); the
  measured h200 profile sets it;
* `optimizer_tensor_overhead`: seconds the AdamW step pays per parameter tensor, beyond its
  bytes. On the CPU, torch runs the single-tensor for-loop (foreach kernels exist only for
  CUDA-like devices: `torch.optim.optimizer._get_foreach_kernels_supported_devices`), about
  ten ops per tensor, measured at 17-29 us. On a GPU the default foreach AdamW updates
  whole lists per launch, so the default is 0;
* `comm_overlap`: the share of a phase's compute that collectives may hide under. 1 on GPUs
  (NCCL runs on its own streams and SMs); 0 for the CPU, where gloo's thread and the compute
  thread share the cores (measured: a dp=2 step on 2 cores hides nothing, RESULTS.md);
* `cores` and `threads`: where the devices of a node are processes sharing its cores (CPU
  ranks), how many cores there are and how many threads each process computes with (the
  rates above are one such process's, alone). More ranks than cores take turns: each
  computes at cores / (ranks x threads) of its rate (`shared_by`). None for devices of their
  own (GPUs), and for the nominal CPU profile, whose machine is not known.

A link follows the alpha-beta model (Hockney 1994; the form of nccl-tests'
PERFORMANCE.md): one hop of n bytes costs `alpha + n / bandwidth` seconds. A call also
waits for its peers (`wait`, once per call): in training a collective or a transfer comes
after compute, and the ranks do not finish their compute at the same instant, so the first
to arrive waits for the last. Measured on the CPU (`cost.calibrate`): a 1-element all-reduce
after 1.5 ms of matmuls costs 0.4-1.0 ms more than the matmuls alone, against 0.26 ms back
to back, 2 ranks on 2 cores. More ranks than cores wait longer, for a peer the scheduler has
not yet run (`shared_wait`: 1.5-1.7 ms a call at 4 ranks on 2 cores, whatever the kind of
call or its group); `shared_by` gives the links the wait of that many ranks, and their
share of the cores' copy bandwidth. 0 on GPUs, where NCCL's kernels queue behind the
compute. GPU link numbers
are docs/design.md's (about 370 GB/s ring bus bandwidth on 8x H100/H200 NVLink, nccl-tests
issues #212 and #272).

The `cpu` profile is measured on the running machine (`fxpar.cost.calibrate`) and cached;
`hardware_profile("cpu", measured=False)` gives fixed nominal numbers instead, for decisions
that every rank must take identically (gradient-bucket sizes at compile time).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fxpar.cost import matmul_table
from fxpar.cost.matmul_table import MatmulTable


@dataclass(frozen=True, kw_only=True)
class Link:
    """One hop of a collective: `alpha` seconds of latency, `bandwidth` bytes per second; and
    `wait`, the seconds a call waits for its peers to arrive (module doc)."""

    alpha: float
    bandwidth: float
    wait: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense matmul FLOP/s of one device, by math precision
    matmul_efficiency: float  # share of peak that large matmuls reach
    memory_bandwidth: float  # bytes/s a large device copy reaches
    intra_node: Link  # between devices of one node (NVLink, or loopback for CPU processes)
    inter_node: Link  # between nodes (InfiniBand / Ethernet)
    devices_per_node: int
    attention_efficiency: float = 0.6  # attention's share of the matmul rate (module doc)
    elementwise_efficiency: float = 1.0  # other ops' share of memory bandwidth
    op_overhead: float = 5e-6  # seconds per forward op and per backward node
    optimizer_tensor_overhead: float = 0.0  # seconds per parameter tensor of an AdamW step
    kernel_launch: float = 5e-6  # seconds per kernel of a compiled graph (module doc)
    compiled_call: float = 80e-6  # host seconds per call of a compiled graph (module doc)
    fused_bandwidth: float | None = None  # bytes/s of Inductor's fused kernels; None: memory_bandwidth
    comm_overlap: float = 1.0  # share of a phase's compute collectives hide under
    compile_pays: bool = True  # the planner searches compile=inductor (module doc)
    bandwidths: dict[str, float] = field(default_factory=dict)  # bytes/s by class of op, where measured
    host_overlap: bool = False  # kernels run while the host dispatches the next ops (module doc)
    optimizer_bytes_per_parameter: float | None = None  # Adam's b where measured (`cost.optimizer`)
    cores: int | None = None  # cores a node's ranks share (CPU processes), or None (module doc)
    threads: int = 1  # compute threads of one rank, where `cores` is given
    shared_wait: float | None = None  # a call's wait at 2 x cores ranks, where measured (module doc)
    matmul_tables: dict[str, MatmulTable] = field(default_factory=dict)  # rates by shape, by precision
    measured: dict[str, object] = field(default_factory=dict)  # raw calibration readings

    def matmul_rate(self, precision: str) -> float:
        """FLOP/s a large matmul reaches in `precision` ("fp32" or "bf16")."""
        return self.peak_flops[precision] * self.matmul_efficiency

    def matmul_seconds(self, m, k, n, precision: str):
        """Seconds of one (m, k, n) matmul (2 m k n FLOPs): at its shape's rate where the profile
        measured a table for `precision`, else at `matmul_rate`. Numbers or sympy formulas."""
        table = self.matmul_tables.get(precision)
        return 2 * m * k * n / self.matmul_rate(precision) if table is None else matmul_table.seconds(table, m, k, n)

    def attention_rate(self, precision: str) -> float:
        """FLOP/s of attention, forward and backward, under `cost.ops`' FLOP convention."""
        return self.matmul_rate(precision) * self.attention_efficiency

    def elementwise_bandwidth(self, kind: str = "pointwise") -> float:
        """Bytes/s the non-matmul ops of class `kind` (`cost.ops.BYTE_KINDS`) reach, forward and
        backward, bytes as `cost.ops` counts them: the profile's own for that class where it
        measured one (`bandwidths`; activation functions as pointwise ops where only those were
        measured), else `elementwise_efficiency` x memory bandwidth."""
        if kind == "activation" and kind not in self.bandwidths:
            kind = "pointwise"
        return self.bandwidths.get(kind, self.memory_bandwidth * self.elementwise_efficiency)

    def kernel_seconds(self, attention_flops, other_bytes, precision: str):
        """One forward of the ops that are not dense matmuls, per-op overhead aside: attention's
        FLOPs at the attention rate, the other ops' bytes (a total, or a dict by class of op) at
        the bandwidth they reach (a backward takes twice this: Narayanan et al. 2021). Dense
        matmuls are `matmul_seconds`' to price, each at its shape. With it the one pricing rule
        of the estimate and the pipeline cut (`cost.step_time`, `cost.ops.node_seconds`);
        numbers or sympy formulas alike."""
        attention = attention_flops / self.attention_rate(precision)
        if not isinstance(other_bytes, dict):
            other_bytes = {"pointwise": other_bytes}
        streamed = sum(b / self.elementwise_bandwidth(kind) for kind, b in other_bytes.items())
        return attention + streamed

    def fused_seconds(self, moved):
        """Seconds Inductor's fused kernels take to move `moved` bytes (module doc)."""
        return moved / (self.fused_bandwidth or self.memory_bandwidth)

    def shared_by(self, ranks: int) -> Hardware:
        """This device as each of `ranks` ranks sees it when they compute at once on one
        node's `cores` (module doc): compute rates divided and per-op overheads multiplied
        by the slowdown s = ranks x threads / cores, where that exceeds 1; the links'
        bandwidth divided by s too (gloo over loopback copies its bytes on the same cores:
        a 4 MiB all-reduce over 4 ranks on 2 cores reached 0.46 GB/s of wire bytes against
        1.29 over 2); and each call's wait for its peers taken from `wait` at s = 1 towards
        `shared_wait`, measured at s = 2, linearly in s. Alpha is left as measured."""
        slowdown = 1.0 if self.cores is None else min(ranks, self.devices_per_node) * self.threads / self.cores
        if slowdown <= 1:
            return self

        def shared(link: Link) -> Link:
            wait = link.wait if self.shared_wait is None else link.wait + (slowdown - 1) * (self.shared_wait - link.wait)
            return replace(link, bandwidth=link.bandwidth / slowdown, wait=wait)

        links = {"intra_node": shared(self.intra_node), "inter_node": shared(self.inter_node)}
        return replace(
            self,
            peak_flops={k: v / slowdown for k, v in self.peak_flops.items()},
            memory_bandwidth=self.memory_bandwidth / slowdown,
            bandwidths={k: v / slowdown for k, v in self.bandwidths.items()},
            matmul_tables={k: table.scaled(1 / slowdown) for k, table in self.matmul_tables.items()},
            op_overhead=self.op_overhead * slowdown,
            kernel_launch=self.kernel_launch * slowdown,
            compiled_call=self.compiled_call * slowdown,
            fused_bandwidth=self.fused_bandwidth and self.fused_bandwidth / slowdown,
            optimizer_tensor_overhead=self.optimizer_tensor_overhead * slowdown,
            **links,
        )

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
}

NOMINAL_CPU = Hardware(
    name="cpu",
    peak_flops={"fp32": 5e10, "bf16": 5e10},
    matmul_efficiency=1.0,
    memory_bandwidth=5e9,
    intra_node=Link(alpha=50e-6, bandwidth=2e9),  # gloo over loopback TCP
    inter_node=Link(alpha=100e-6, bandwidth=1.25e9),  # 10 GbE
    devices_per_node=1024,  # CPU processes of one machine: all "intra-node"
    attention_efficiency=0.5,  # the middle of the 0.4-0.65 measured (module doc)
    elementwise_efficiency=0.4,  # the middle of the 0.3-0.5 measured (module doc)
    op_overhead=9e-6,  # per op as op_counts counts them, measured 9 us on a block (cost.calibrate)
    optimizer_tensor_overhead=20e-6,  # torch's for-loop AdamW, measured 17-29 us
    comm_overlap=0.0,
    compile_pays=False,  # a compiled step took what an eager one did (module doc)
)
