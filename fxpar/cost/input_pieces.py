"""A rank's piece of a module's inputs, for the fake forwards that price its activations.

A module's placeholders carry export's fake values, global in every dim. A pipeline stage under
sequence parallelism receives only its tp shard of the sequence of each boundary tensor
(`ir.stages.Boundary.placement`), which its graph gathers before attention, and under context
parallelism its cp slice, whose views its graph sizes for the slice; a fake forward fed the
global value would gather twice the sequence, or view it at the wrong length. The batch dim stays global: the estimate
prices the global batch and substitutes a rank's share afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.placement import Shard

Pieces = Mapping[str, tuple[int, int]]  # placeholder name -> (dim, parts) a rank holds one of


def boundary_pieces(program: CompiledProgram) -> Pieces:
    """The stage inputs a rank receives as a piece of the sequence, by name: (dim, tp) under
    sequence parallelism, (dim, cp) under context parallelism (the plan has one or the other)."""
    sizes = program.mesh.sizes
    return {b.name: (b.placement[axis].dim, sizes[axis]) for stage in program.stages or () for b in stage.inputs
            for axis in ("tp", "cp") if isinstance(b.placement[axis], Shard) and sizes[axis] > 1}


def piece_values(placeholders: list[fx.Node], pieces: Pieces) -> list:
    """Each placeholder's fake value, or for one named in `pieces` its first equal piece along
    the dim, in a storage of its own as the rank receives it (a view would count the whole
    value's bytes where an op saves it); the length's divisibility is told to the shape
    environment, so that the graph's gather of the pieces has the global length again
    (2 * (seq // 2) is seq)."""
    values = [n.meta.get("val") for n in placeholders]
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    assert fake_mode is not None, "captured graphs carry export's fake tensors"
    for i, node in enumerate(placeholders):
        if node.name in pieces:
            dim, parts = pieces[node.name]
            with fake_mode:
                torch._check(values[i].shape[dim] % parts == 0)
                piece = values[i].narrow(dim, 0, values[i].shape[dim] // parts)
                values[i] = piece.clone(memory_format=torch.contiguous_format)  # its own storage, as received
    return values
