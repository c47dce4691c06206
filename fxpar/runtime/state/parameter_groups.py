"""Optimizer parameter groups: which options each of the model's parameters is stepped with.

    decay = [p for p in model.parameters() if p.dim() >= 2]    # nanoGPT's configure_optimizers
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = runner.optimizer(torch.optim.AdamW, lr=6e-4, weight_decay=0.1,
                           param_groups=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])

A group names its parameters as the model given to `fxpar.compile` has them: the Parameters
themselves or their names (`model.named_parameters()`'s, a tied alias standing for its
weight); the rest of the dict is the group's options over the keyword defaults, as torch.optim
takes them. A rank does not step those Parameters (it steps its tensor-parallel shards, ZeRO's
pieces or flat shards, bf16-mixed's fp32 masters), so the groups are resolved to names once,
here, and every optimizer `runner.optimizer` builds asks `group_of(name)`:

    plain, ZeRO-3, bf16-mixed   each local parameter, piece or master joins its name's group;
    ZeRO-1/2                    this rank's shard of a flat bucket crosses parameters: it is
                                cut into runs of one group (`ShardedOptimizer`).

Every rank builds every group, empty or not, in the order given, so the groups a scheduler
sets, a checkpoint saves and the full optimizer state lists are the same on every rank and
under every plan. A parameter is in one group at most. As torch.optim's, the groups step
exactly the parameters they name, so another optimizer may step the rest (torch's Muon for
the hidden matrices and AdamW for the others, as its documentation advises; a checkpoint takes
the list of them). Under ZeRO-1/2 one optimizer steps every trained parameter: its step
gathers the whole flat buckets (`ShardedOptimizer` says so if its groups leave one out).
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.errors import PlanError


@dataclass(frozen=True)
class ParameterGroups:
    """The groups of one optimizer, by canonical parameter name (module doc)."""

    names: tuple[tuple[str, ...], ...]  # per group, its parameters' canonical names, in the order given
    options: tuple[dict[str, Any], ...]  # per group, its own options (the defaults fill the rest)
    aliases: Mapping[str, str]  # tied alias -> canonical name
    _index: dict[str, int] = field(init=False, repr=False, compare=False)  # canonical name -> group

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {n: i for i, names in enumerate(self.names) for n in names})

    @classmethod
    def whole(cls, parameters: Mapping[str, torch.nn.Parameter], aliases: Mapping[str, str]) -> ParameterGroups:
        """One group of every parameter, in the model's order: `torch.optim`'s over `model.parameters()`."""
        return cls((tuple(parameters),), ({},), dict(aliases))

    @classmethod
    def resolve(cls, groups: Sequence[Mapping[str, Any]], parameters: Mapping[str, torch.nn.Parameter],
                aliases: Mapping[str, str]) -> ParameterGroups:
        """`groups` as torch.optim takes them, each parameter named by the model's Parameter or
        its name, checked against the model's `parameters` (canonical name -> Parameter)."""
        if isinstance(groups, Mapping) or not isinstance(groups, Sequence) or not groups:
            raise _error("must be a non-empty list of dicts, each with 'params'", groups)
        by_id = {id(p): n for n, p in parameters.items()}
        names, options, group_of = [], [], {}
        for index, group in enumerate(groups):
            if not isinstance(group, Mapping) or "params" not in group:
                raise _error(f"[{index}] is not a dict with 'params'", group)
            listed = group["params"]
            listed = [listed] if isinstance(listed, (str, torch.Tensor)) else list(listed)
            resolved = []
            for item in listed:
                name = _name_of(item, index, by_id, parameters, aliases)
                if name in group_of:
                    raise _error(f"[{index}] lists {name!r}, already in param_groups[{group_of[name]}]: a "
                                 "parameter is stepped in one group", name)
                group_of[name] = index
                resolved.append(name)
            names.append(tuple(resolved))
            options.append({k: v for k, v in group.items() if k != "params"})
        return cls(tuple(names), tuple(options), dict(aliases))

    def group_of(self, name: str) -> int | None:
        """The group of parameter `name` (a canonical name or a tied alias), None if in none."""
        return self._index.get(self.aliases.get(name, name))

    def torch_groups(self, tensors: Iterable[tuple[int, torch.Tensor]]) -> list[dict[str, Any]]:
        """torch.optim's groups of `tensors` ((group, tensor) pairs): every group, in order,
        holding its tensors in the order met, empty where this rank steps none of it."""
        params: list[list[torch.Tensor]] = [[] for _ in self.names]
        for group, tensor in tensors:
            params[group].append(tensor)
        return [{"params": p, **o} for p, o in zip(params, self.options)]


def warn_unstepped(names: list[str]) -> list[str]:
    """Warn that the trained parameters `names` are in no group of the runner's optimizers (so
    no step changes them, as on one device); returns the empty list left to warn of."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    warnings.warn(f"fxpar: trained parameter {names[0]!r}{more} is in no group of the runner's optimizers, so "
                  "no optimizer step changes it. Fix: add it to a group, or set requires_grad=False before "
                  "fxpar.compile", stacklevel=3)
    return []


def _name_of(item, index: int, by_id: Mapping[int, str], parameters: Mapping[str, torch.nn.Parameter],
             aliases: Mapping[str, str]) -> str:
    if isinstance(item, str):
        name = aliases.get(item, item)
        if name not in parameters:
            close = difflib.get_close_matches(item, [*parameters, *aliases], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _error(f"[{index}] names {item!r}, which is none of the model's parameters{hint}", item)
        return name
    if isinstance(item, torch.Tensor) and id(item) in by_id:
        return by_id[id(item)]
    what = f"a tensor of shape {tuple(item.shape)}" if isinstance(item, torch.Tensor) else repr(item)
    raise _error(f"[{index}] lists {what}, which is none of the parameters of the model given to "
                 "fxpar.compile. Fix: list that model's Parameters or their names", what)


def _error(problem: str, value) -> PlanError:
    text = problem if "Fix:" in problem else (
        f"{problem}. Fix: pass torch.optim's form, [{{'params': [...], 'weight_decay': 0.0}}, ...], "
        "naming the compiled model's parameters (its Parameters or their names)")
    return PlanError(f"runner.optimizer(param_groups=...) {text}", field="param_groups", value=value)
