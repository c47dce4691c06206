"""Data parallelism: gradient buckets in the exact order backward produces gradients.

DDP (Li et al. 2020, "PyTorch Distributed", Sec. 3.2) groups gradients into buckets so that
one all-reduce moves many of them, and launches each bucket's all-reduce as soon as its last
gradient is ready, overlapping communication with the rest of backward. DDP guesses the
order from `model.parameters()` reversed and rebuilds its buckets after a first iteration.
fxpar reads the order from the captured graph instead: a parameter's gradient is complete
when backward has passed its *first* use in forward, so sorting parameters by first use,
latest first (and, within one op, later arguments first, as autograd delivers them), is the
order in which their gradients become ready. No warm-up iteration.

This pass only annotates; the runtime (`fxpar.runtime.state.gradient_buckets`) attaches the hooks
that launch the all-reduces.

    before: %h_1_mlp_down_weight : get_attr[target=h.1.mlp.down.weight]
    after:  the same node, with node.meta["fxpar.bucket"] = 0, and
            gm.meta["fxpar.buckets"] = (Bucket(index=0, parameters=("ln_f.weight", ...)), ...)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.ir import meta
from fxpar.ir.buckets import Bucket
from fxpar.ir.graph_paths import nodes_reaching_output
from fxpar.ir.mesh import Mesh
from fxpar.ir.placement import local_numel
from fxpar.passes.contracts import broken, ensures


def every_parameter_in_one_bucket(gm: fx.GraphModule) -> None:
    """Ensures: each trained parameter that reaches the loss is in exactly one bucket, and its
    node names that bucket."""
    nodes = meta.parameter_nodes(gm.graph)
    seen: set[str] = set()
    for bucket in meta.graph_buckets(gm):
        for name in bucket.parameters:
            if name in seen or nodes[name].meta.get(meta.BUCKET) != bucket.index:
                raise broken(f"parameter {name} is in one bucket, {bucket.index}, and says so", nodes[name])
            seen.add(name)
    reaching = nodes_reaching_output(gm.graph)
    for name, node in nodes.items():
        if name not in seen and node in reaching and gm.get_parameter(name).requires_grad and not _expert(node):
            raise broken(f"trained parameter {name} is in a bucket", node)


@ensures(every_parameter_in_one_bucket)
def assign_gradient_buckets(
    gm: fx.GraphModule, *, bucket_bytes: int, mesh: Mesh = Mesh(), hold: bool = False,
    reduce_dtype: torch.dtype | None = None,
) -> fx.GraphModule:
    """Put every parameter that receives a gradient into a bucket of about `bucket_bytes`.

    Requires: `fxpar.parameter` on the get_attr node of each parameter (trace.capture);
    `fxpar.ir.placement` where a pass split a parameter (sizes are this rank's piece on `mesh`).
    Ensures: each parameter that requires grad and reaches the loss is in exactly one bucket,
    but an expert's weights under expert parallelism (summed over edp instead)
    (tied parameters are one parameter, so they are reduced once), its node carries
    `fxpar.bucket`, and `gm.meta["fxpar.buckets"]` lists the buckets in launch order:
    bucket 0 holds the gradients that become ready first. A bucket is closed once it holds
    at least `bucket_bytes` (DDP's rule), and never mixes dtypes.

    `hold` (ZeRO): a parameter whose gradient is summed at the end of the step before it is
    whole (`fxpar.grad_partial` over tp, `fxpar.tied_across_stages` over the pipeline) gets a
    bucket of its own, `held`: the runtime reduce-scatters it over dp after that sum, where
    the other buckets go out as their gradients are ready. (An all-reduce commutes with the
    sum; a reduce-scatter, which leaves each rank one shard, does not.)
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    ready = _gradients_in_ready_order(gm)
    buckets = _fill_buckets(ready, bucket_bytes=bucket_bytes, mesh=mesh, hold=hold, reduce_dtype=reduce_dtype)
    gm.meta[meta.GRAPH_BUCKETS] = tuple(buckets)
    return gm


# A parameter that receives a gradient: its name, node, tensor and the dtype the graph computes it in.
_Gradient = tuple[str, fx.Node, torch.nn.Parameter, torch.dtype]


def _gradients_in_ready_order(gm: fx.GraphModule) -> list[_Gradient]:
    """The parameters that receive a gradient, in the order backward completes their
    gradients (module doc)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    reaches_loss = nodes_reaching_output(gm.graph)
    ready_order = []
    for name, node in meta.parameter_nodes(gm.graph).items():
        value = gm.get_parameter(name)
        if not (value.requires_grad and node in reaches_loss) or _expert(node):
            continue
        first_user = min(node.users, key=order.__getitem__)
        # Among parameters of one op, autograd hands out later arguments' gradients first
        # (a linear's bias before its weight), so later arguments go first.
        position = first_user.all_input_nodes.index(node)
        # The dtype the graph computes it in (bf16 under mixed precision), the tensor's shape.
        value_dtype = node.meta["val"].dtype if "val" in node.meta else value.dtype
        ready_order.append(((-order[first_user], -position), name, node, value, value_dtype))
    ready_order.sort(key=lambda item: item[0])
    return [(name, node, value, value_dtype) for _, name, node, value, value_dtype in ready_order]


def _fill_buckets(
    ready: list[_Gradient], *, bucket_bytes: int, mesh: Mesh, hold: bool, reduce_dtype: torch.dtype | None,
) -> list[Bucket]:
    """Deal the gradients, `ready` in the order backward completes them, into buckets as
    `assign_gradient_buckets` describes, and mark each parameter's node with its bucket."""
    buckets: list[Bucket] = []
    names: list[str] = []
    numel, dtype = 0, None

    def close() -> None:
        nonlocal names, numel
        if names:
            buckets.append(Bucket(len(buckets), tuple(names), numel, dtype, reduce_dtype=_other(reduce_dtype, dtype)))
        names, numel = [], 0

    for name, node, value, value_dtype in ready:
        size = local_numel(value.shape, meta.placements(node), mesh.sizes)
        if hold and (node.meta.get(meta.GRAD_PARTIAL) or node.meta.get(meta.TIED_ACROSS_STAGES)):
            close()
            node.meta[meta.BUCKET] = len(buckets)
            buckets.append(Bucket(len(buckets), (name,), size, value_dtype, held=True,
                                  reduce_dtype=_other(reduce_dtype, value_dtype)))
            continue
        if dtype is not None and value_dtype != dtype:
            close()
        dtype = value_dtype
        names.append(name)
        numel += size
        node.meta[meta.BUCKET] = len(buckets)
        if numel * dtype.itemsize >= bucket_bytes:
            close()
    close()
    return buckets


def _expert(node: fx.Node) -> bool:
    """An expert's weights under expert parallelism: their gradient is summed over the ranks
    holding the same experts (edp, `passes.expert_parallel`), not over dp in a bucket."""
    return "edp" in node.meta.get(meta.GRAD_PARTIAL, ())


def carries_loss(buckets: tuple[Bucket, ...]) -> bool:
    """Whether DDP's last bucket can carry the step's loss as one extra element: only a bucket
    kept and reduced in fp32, so that the loss reaches the user in fp32 (else, as under
    bf16-mixed, the loss is all-reduced alone)."""
    return all(b.dtype == b.reduced_dtype == torch.float32 for b in buckets[-1:])


def _other(reduce_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype | None:
    return None if reduce_dtype in (None, dtype) else reduce_dtype
