"""The whole model in one safetensors file, and the whole optimizer state beside it.

    runner.save_full("model.safetensors", optimizer=opt)   # every rank calls it; rank 0 writes
                                                           # (a list: model.optimizer.<i>.safetensors)
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))      # one device
    optimizer = torch.optim.AdamW(model.parameters(), ...)   # or the groups runner.optimizer had
    optimizer.load_state_dict(load_full_optimizer_state("model.optimizer.safetensors", model))

The tensors are gathered by `runner.full_state_dict()` and `runner.full_optimizer_state_dict()`,
whose collectives are the state programs' (`Program.state_program`, verified by `check()`),
then rank 0 writes each file through a temporary one renamed into place. safetensors holds
tensors and a str -> str header only, so loading runs no code: the optimizer's options
travel as JSON in the header, its state as `state.<name>.<key>` tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fxpar.errors import CheckpointError

OPTIMIZER_SUFFIX = ".optimizer.safetensors"


def optimizer_path(path: str | Path, index: int | None = None) -> Path:
    """Where `save_full(path, optimizer=...)` writes the optimizer: `model.safetensors` ->
    `model.optimizer.safetensors`; of a list of optimizers, the `index`th's to
    `model.optimizer.<index>.safetensors`."""
    path = Path(path)
    stem = path.name[: -len(".safetensors")] if path.name.endswith(".safetensors") else path.name
    return path.with_name(stem + (OPTIMIZER_SUFFIX if index is None else f".optimizer.{index}.safetensors"))


def write_full(path: str | Path, state: dict[str, torch.Tensor],
               optimizer_state: dict[str, Any] | list[dict[str, Any]] | None) -> None:
    """Write the gathered `state` (and `optimizer_state` as `full_optimizer_state_dict` gives
    it, or a list of such, one file each)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomically(path, lambda p: save_file({k: v.contiguous() for k, v in state.items()}, p,
                                          metadata={"format": "pt"}))
    if optimizer_state is None:
        return
    listed = isinstance(optimizer_state, list)
    for index, each in enumerate(optimizer_state if listed else [optimizer_state]):
        tensors = {f"state.{name}.{key}": value.contiguous()
                   for name, entries in each["state"].items() for key, value in entries.items()}
        groups = json.dumps(each["param_groups"], default=_plain)
        _atomically(optimizer_path(path, index if listed else None),
                    lambda p: save_file(tensors, p, metadata={"format": "pt", "param_groups": groups}))


def load_full_optimizer_state(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """The optimizer state `save_full` wrote, as `torch.optim.Optimizer.load_state_dict` takes
    it for an optimizer over `model`'s parameters in the groups `runner.optimizer` had (one
    group of `model.parameters()` without `param_groups`): torch matches parameters by position,
    numbered on across the groups, so each group's names are numbered in the order saved."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no optimizer state at {path}. Fix: runner.save_full(..., optimizer=opt) writes it")
    with safe_open(str(path), framework="pt") as file:
        groups = json.loads((file.metadata() or {}).get("param_groups", "null"))
        if not isinstance(groups, list) or not groups or not all(isinstance(g.get("params"), list) for g in groups):
            raise CheckpointError(f"{path} has no parameter groups in its header: not written by runner.save_full")
        by_name: dict[str, dict[str, torch.Tensor]] = {}
        for key in file.keys():
            name, _, state_key = key.removeprefix("state.").rpartition(".")
            by_name.setdefault(name, {})[state_key] = file.get_tensor(key)
    names = dict(model.named_parameters(remove_duplicate=False))
    listed = [name for group in groups for name in group["params"]]
    unknown = sorted({*by_name, *listed} - set(names))
    if unknown:
        raise CheckpointError(f"{path} holds optimizer state of {unknown[0]!r}, which the model has no parameter "
                              f"named ({len(unknown)} such). Fix: load it with the model it was saved from")
    number = iter(range(len(listed)))
    for group in groups:
        if isinstance(group.get("betas"), list):  # torch.optim keeps it as a tuple
            group["betas"] = tuple(group["betas"])
        group["params"] = [next(number) for _ in group["params"]]
    state = {index: by_name[name] for index, name in enumerate(listed) if name in by_name}
    return {"state": state, "param_groups": groups}


def _atomically(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".tmp")
    write(str(temporary))
    with open(temporary, "rb") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"optimizer option {value!r} is not JSON")
