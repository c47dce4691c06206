"""Activation memory under `compile=inductor`: what the compiled forward keeps for backward.

Eager mode saves what each op's autograd formula saves (`cost.activations`). A compiled module
saves what AOTAutograd's partitioner chose to pass from the compiled forward to the compiled
backward: it recomputes cheap intermediates instead of keeping them, and keeps some that no
eager op would (a layer norm's rstd, attention's logsumexp). The forward graph Inductor
compiles (`cost.compiled_graphs`) returns, after the module's own outputs, exactly what the
compiled backward reads; their bytes, each storage once (a saved view counts as its base), the
module's parameters, buffers and the step's given inputs left out as the runtime's meter
leaves them, are the estimate's activations. On the tiny GPT under dp=2 it predicts 4672
batch seq + 136 seq bytes: 301,184 at 4 x 16, the byte count the meter measured in the
compiled step (eager's formula: 299,652).

Each checkpoint region also saves the generator's state to draw again what it drew (CPU:
5,056 bytes), as the meter measures.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from fxpar.cost.compiled_graphs import PartitionedGraphs
from fxpar.cost.fused_kernels import storage
from fxpar.frontend.trace import CapturedGraph

def compiled_saved_bytes(graphs: PartitionedGraphs, captured: CapturedGraph, given: set[str]) -> sympy.Expr:
    """Bytes the compiled forward of a module (its partitioned `graphs`) keeps for backward
    (module doc), a formula in the example's batch and sequence; `given`: the step's inputs."""
    forward = graphs.forward
    primals = [n for n in forward.graph.nodes if n.op == "placeholder"]
    saved = forward.graph.output_node().args[0][graphs.returned:]  # after the module's own outputs
    bases: dict[fx.Node, object] = {}
    for node in saved:
        if not (isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)):
            continue  # the sizes the backward reads
        base = storage(node)  # a saved view holds its base's bytes
        if base.op == "placeholder":
            index = primals.index(base) - graphs.state
            if index < 0 or graphs.placeholders[index] in given:
                continue  # model state, or the step's batch
        value = base.meta["val"]
        bases[base] = _rng_state_bytes(graphs.device) if _is_rng_state(base) else value.numel() * value.element_size()
    return sympy.expand(captured.readable(sum(bases.values(), 0)))


def _is_rng_state(node: fx.Node) -> bool:
    """A generator state a recomputed region saved to draw again what its forward drew."""
    source = node.args[0] if node.op == "call_function" and node.args else None
    return isinstance(source, fx.Node) and getattr(source.target, "__name__", "") == "run_and_save_rng_state"


def _rng_state_bytes(device: torch.device) -> int:
    """Bytes of a generator's state: the CPU's Mersenne twister, CUDA's seed and offset. The
    partitioner leaves its size symbolic (unknown until run)."""
    return torch.get_rng_state().numel() if device.type == "cpu" else 16

