"""Expert parallelism for experts that multiply every token: batched matmuls over the experts.

Llama 4's experts (transformers' `Llama4TextExperts`) run every expert on every token, the
router's score (zero where the expert was not chosen) already multiplied into its copy of the
token, as two `bmm`s over the 3D expert weights:

    %x   = view(%tokens_times_scores, [E, T, H])             expert e's copy of every token
    %h   = bmm(%x, %gate_up)                                 (E, T, 2I)   gate_up: (E, H, 2I)
    ...    up * silu(gate)
    %y   = bmm(%h', %down)                                   (E, T, H)    down: (E, I, H)
    ...    view(-1, H), then summed over the experts

Under `ep=n` a rank holds L = E/n of the experts and computes them for the expert group's
tokens. Expert e's copies of the tokens go to the rank holding e, and the results come back, by
an all-to-all over the experts' dim, each rank's block of L experts to its rank (static sizes:
every expert takes every token):

    %mine = all_to_all(%x, 'ep', n, 0)                       (E, T, H): [j] rank j's copies for my experts
    %x'   = reshape(permute(view(%mine, [n, L, T, H]), [1, 0, 2, 3]), [L, nT, H])
    %h    = bmm(%x', %gate_up_local) ... %y' = bmm(%h', %down_local)      (L, nT, H)
    %y    = all_to_all(reshape(permute(view(%y', [L, n, T, H]), [1, 0, 2, 3]), [E, T, H]), 'ep', n, 0)

Each product is one device's; an expert's gradient sums its whole expert group's tokens, a
partial sum over edp as the grouped experts' (`passes.expert_parallel`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.graph_paths import ancestors, descendants
from fxpar.ir.placement import Shard

aten, fxpar_ops = torch.ops.aten, torch.ops.fxpar
AXIS = "ep"


def is_expert_bmm(node: fx.Node) -> bool:
    """A batched matmul of activations by a 3D parameter: each expert's matrix (Llama 4)."""
    if node.op != "call_function" or node.target is not aten.bmm.default:
        return False
    weight = node.args[1]
    return weight.op == "get_attr" and meta.parameter_name(weight) is not None and weight.meta["val"].dim() == 3


def split_bmm_experts(graph: fx.Graph, matmuls: list[fx.Node], ep: int) -> None:
    """Split one layer's batched expert matmuls (those of one module) over ep (module doc)."""
    where = meta.module_path(matmuls[0])
    experts = int(matmuls[0].args[1].meta["val"].shape[0])
    if experts % ep:
        raise PlanError(
            f"plan ep={ep}: the mixture of experts at {where!r} has {experts} experts, which do not "
            f"split over {ep} ranks. Fix: ep dividing {experts} (for example "
            f"ep={max(d for d in range(1, ep + 1) if experts % d == 0)}), or ep=1", field="ep", value=ep)
    downstream = {m: descendants(m) for m in matmuls}
    entries = [m for m in matmuls if not any(m in downstream[o] for o in matmuls if o is not m)]
    exits = [m for m in matmuls if not any(o in downstream[m] for o in matmuls if o is not m)]
    region = ({n for m in entries for n in downstream[m]} & set().union(*(ancestors(e) for e in exits))) - set(matmuls)
    for node in region:
        if any(source not in region and source not in matmuls and not _constant(source)
               for source in node.all_input_nodes):
            raise PlanError(
                f"plan ep={ep}: the mixture of experts at {where!r} cannot be split over ep ranks at "
                f"{node.name} ({node.target}): it reads a value from outside the experts' rows. Fix: "
                "ep=1 for this model", field="ep", value=ep)
    local = experts // ep
    for matmul in entries:
        rows = matmul.args[0]
        mine = _insert(graph, fxpar_ops.all_to_all.default, (rows, AXIS, ep, 0), matmul, like=rows)
        matmul.replace_input_with(rows, _regrouped(graph, mine, (ep, local), (local, -1), matmul))
    for matmul in matmuls:
        weight = matmul.args[1]
        meta.set_placement(weight, AXIS, Shard(0))
        if meta.requires_grad(weight) and "edp" not in weight.meta.get(meta.GRAD_PARTIAL, ()):
            meta.mark_gradient_partial(weight, "edp")
    for node in graph.nodes:  # the rows between the matmuls are the group's now: their `val`s again
        if node in matmuls:  # (the weights' `val`s are whole: their placements say what a rank holds)
            rows, weights = (n.meta["val"] for n in node.args)
            node.meta["val"] = rows.new_empty((*rows.shape[:2], weights.shape[2]))
        elif node in region:
            node.meta["val"] = node.target(*fx.node.map_arg(node.args, lambda n: n.meta["val"]),
                                           **fx.node.map_arg(node.kwargs, lambda n: n.meta["val"]))
    for matmul in exits:
        users, after = list(matmul.users), matmul.next
        back = _regrouped(graph, matmul, (local, ep), (experts, -1), after)
        returned = _insert(graph, fxpar_ops.all_to_all.default, (back, AXIS, ep, 0), after, like=matmul)
        for user in users:
            user.replace_input_with(matmul, returned)


def _regrouped(graph: fx.Graph, x: fx.Node, blocks: tuple[int, int], shape: tuple[int, int], before: fx.Node) -> fx.Node:
    """(a, b, T, H) blocks of `x`'s first two dims swapped: `reshape(permute(view(x, [*blocks,
    -1, H]), [1, 0, 2, 3]), [*shape, H])`."""
    width = x.meta["val"].shape[-1]
    split = _insert(graph, aten.view.default, (x, [*blocks, -1, width]), before, like=x)
    swapped = _insert(graph, aten.permute.default, (split, [1, 0, 2, 3]), before, like=x)
    return _insert(graph, aten.reshape.default, (swapped, [*shape, width]), before, like=x)


def _constant(node: fx.Node) -> bool:
    return node.op == "get_attr" and meta.parameter_name(node) is None


def _insert(graph: fx.Graph, target, args: tuple, before: fx.Node, *, like: fx.Node) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
    node.meta[meta.MODULE_PATH] = meta.module_path(like)
    node.meta[meta.REQUIRES_GRAD] = meta.requires_grad(like)
    if meta.PLACEMENT in like.meta:
        node.meta[meta.PLACEMENT] = meta.placements(like)
    return node
