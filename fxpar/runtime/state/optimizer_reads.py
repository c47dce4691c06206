"""Which optimizers may step a piece of a parameter, and the check that refuses the others.

An optimizer that treats every element alone (SGD, Adam, AdamW, ...) steps a piece of a
tensor exactly as it steps that part of the whole tensor, so it may be handed whatever a
rank holds. One that reads a whole tensor would compute something else on a piece, with
nothing to say so: LBFGS's line search, LAMB's per-tensor trust ratio, Adafactor's factored
row and column moments, Muon's orthogonalised update. A rank holds pieces where the plan
splits a parameter:

    tensor parallelism   a Shard(d) placement on tp: its rows or columns
    ZeRO-3               a FlatShard placement on dp: a flat piece
    ZeRO-1/2             the rank's shard of a flat bucket, crossing parameters

so `runner.optimizer` refuses an optimizer not known to be elementwise wherever it would step
such a piece, naming the parameter and its placement (`elementwise=True` vouches for a class
fxpar does not know); replicated parameters (dp, pp) are whole and take any optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import FlatShard, Shard

ELEMENTWISE = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
}


def require_elementwise(optimizer_class: type, *, elementwise: bool, steps: str, field: str, value: object,
                        whole: str) -> None:
    """Refuse `optimizer_class` unless it is elementwise, saying that the plan (`field`=`value`)
    `steps` pieces and that `whole` would keep them whole."""
    if optimizer_class in ELEMENTWISE or elementwise:
        return
    raise PlanError(
        f"plan {field}={value} steps {steps}, so the optimizer must treat every element alone; "
        f"{optimizer_class.__name__} is not known to (it may read whole tensors: a trust ratio, "
        "factored moments, an orthogonalised update, a line search). Fix: use an elementwise "
        f"optimizer (SGD, Adam, AdamW, ...), {whole}, or runner.optimizer(cls, elementwise=True, ...) "
        "if it is elementwise",
        field=field,
        value=value,
    )


def require_elementwise_for_pieces(optimizer_class: type, modules: Iterable[torch.fx.GraphModule], stepped,
                                   *, plan, elementwise: bool) -> None:
    """Refuse a non-elementwise optimizer if it would step a parameter `plan` splits on this
    rank (tp's Shard, ZeRO-3's FlatShard), among the parameters of `modules` that
    `stepped(name)` says it steps."""
    if optimizer_class in ELEMENTWISE or elementwise:
        return
    for module in modules:
        for name, node in meta.parameter_nodes(module.graph).items():
            if not stepped(name):
                continue
            placements = meta.placements(node)
            if isinstance(placements["dp"], FlatShard):
                require_elementwise(optimizer_class, elementwise=elementwise, field="zero", value=plan.zero,
                                    whole="zero=0", steps=f"this rank's flat piece of {name} ({placements})")
            if isinstance(placements["tp"], Shard):
                require_elementwise(optimizer_class, elementwise=elementwise, field="tp", value=plan.tp,
                                    whole="tp=1", steps=f"this rank's shard of {name} ({placements})")
