"""How fxpar calls a model and finds its loss: the conventions of `trace.capture`.

Inputs come positionally (`(tokens, labels)`, bound to forward's parameters in order) or by
keyword (`{"input_ids": ids, "labels": labels}`, what a Hugging Face model wants: its second
positional parameter is an attention mask or a cache, not `labels`). A step's batch must come
the same way, and `arrange_inputs` puts it in the graph's input order.

The model returns its scalar loss: bare, first in a tuple or list, or as the `loss` of a dict,
a `ModelOutput` or another pytree container with named fields (`loss_leaf`).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping

import torch
from torch.utils import _pytree as pytree

from fxpar.errors import BatchError, CaptureError

ExampleInputs = tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]


def arrange_inputs(
    names: tuple[str, ...], args: tuple, kwargs: Mapping[str, torch.Tensor], *, keyword: bool
) -> tuple[torch.Tensor, ...]:
    """A batch in the order `names`, given as tensors (`args`), a dict (`args == (dict,)`) or
    keywords; `keyword` says whether the example came by keyword.

        arrange_inputs(("input_ids", "labels"), ({"labels": y, "input_ids": x},), {}, keyword=True)
        -> (x, y)
    """
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        args, kwargs = (), args[0]
    if kwargs or args == () and keyword:
        if args:
            raise TypeError("pass a batch either positionally or by keyword, not both")
        expected, given = set(names), set(kwargs)
        if expected != given:
            raise BatchError(
                f"this program takes the inputs {list(names)} (as captured); got {sorted(given)}: "
                f"missing {sorted(expected - given)}, unknown {sorted(given - expected)}. Fix: pass "
                f"exactly the example's keys ({', '.join(names)})"
            )
        return tuple(kwargs[name] for name in names)
    if len(args) != len(names):
        raise BatchError(
            f"this program takes {len(names)} inputs {list(names)} (as captured), got {len(args)}. Fix: pass "
            f"the example's inputs in its order: ({', '.join(names)})"
            + (" by keyword, as the example was" if keyword else "")
        )
    return tuple(args)


def check_keywords(model: torch.nn.Module, inputs: Mapping[str, object]) -> None:
    """Every key must name a parameter of `model.forward` (or a key its `**kwargs` declares)."""
    parameters = inspect.signature(model.forward).parameters
    accepted = {n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for p in parameters.values():
        if p.kind is not p.VAR_KEYWORD:
            continue
        declared = typing.get_args(p.annotation)  # `**kwargs: Unpack[SomeTypedDict]`
        if typing.get_origin(p.annotation) is typing.Unpack and hasattr(declared[0], "__required_keys__"):
            accepted |= declared[0].__required_keys__ | declared[0].__optional_keys__
        else:
            return  # a plain **kwargs takes any key
    unknown = [key for key in inputs if key not in accepted]
    if unknown:
        raise CaptureError(
            f"example input {unknown[0]!r} is not a parameter of {type(model).__name__}.forward, "
            f"which takes {', '.join(n for n in parameters if n not in ('self', 'kwargs'))}. Fix: "
            "rename or drop the key"
        )


def positional_hint(model: torch.nn.Module, count: int) -> str:
    """For positional inputs: which forward parameters they bind to, when that looks wrong."""
    names = [
        n for n, p in inspect.signature(model.forward).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    bound = ", ".join(f"input {i} -> {n!r}" for i, n in enumerate(names[:count]))
    return (
        f"positional inputs bind to forward's parameters in order ({bound}); to pass labels to a "
        "Hugging Face model use keyword inputs: example_inputs={'input_ids': ids, 'labels': labels}"
    )


def loss_leaf(spec: pytree.TreeSpec) -> tuple[int | None, str]:
    """Where the loss is among the flat outputs, and what the output is (for errors).

    A bare tensor; the first item of a tuple or list; the `loss` entry of a dict, a
    `ModelOutput` or another registered container with named fields.
    """
    kind = getattr(spec.type, "__name__", "a tensor") if spec.type is not None else "a tensor"
    if spec.is_leaf():
        return 0, "a tensor that is not a scalar"
    children = spec.children()
    if spec.type in (tuple, list):
        position = 0
        found = f"a {kind} of {len(children)} items whose first is not the scalar loss"
    else:
        keys = [str(k) for k in spec.context] if isinstance(spec.context, (list, tuple)) else []
        found = f"a {kind} with {keys or 'no fields'} and no scalar `loss`"
        if "loss" not in keys:
            return None, found
        position = keys.index("loss")
    if not children or not children[position].is_leaf():
        return None, found
    return sum(c.num_leaves for c in children[:position]), found
