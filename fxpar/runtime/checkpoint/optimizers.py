"""Optimizer state a checkpoint would drop is said aloud: what `runner.save` and `runner.load`
check of their `optimizer=` against the optimizers the runner made.

    opt = runner.optimizer(torch.optim.AdamW, lr=3e-4)
    ...
    runner.save(path)                    # UserWarning: AdamW's state (2 tensors of each of 12
                                         # parameters) is not saved. Fix: optimizer=opt ...
    runner.save(path, optimizer=opt)     # saved
    runner.save(path, optimizer=[])      # the model alone, on purpose: no warning
    runner.load(path)                    # UserWarning: the checkpoint's AdamW state was not
                                         # restored. Fix: runner.load(path, optimizer=opt)
    other_runner.save(path, optimizer=opt)   # CheckpointError: opt is another runner's

[Note: save warns, it does not add] A save without `optimizer=` while an optimizer the runner
made holds state could save that state on its own; it warns instead. A checkpoint holds what
the call lists, in its order, and a load must be given the same list
(`checkpoint._saved_optimizers`): state added behind the caller's back would make the load
they wrote fail, or restore into optimizers they never named. So the warning names each
optimizer left out and the fix, and `optimizer=[]` says "the model alone" on purpose.

An optimizer one runner made steps that runner's tensors (its ZeRO shards, its fp32 masters,
the parameters it placed): given to another runner's save it would write state under names
of parameters it does not step, and given to its load it would be filled with state its
steps never read. Both are a CheckpointError naming the runner that made it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from fxpar.errors import CheckpointError
from fxpar.runtime.state.wrapped_optimizer import inner_optimizer

# optimizer -> (its runner, weakly, and how to name it); `Runner.optimizer` records each one
_MADE_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_maker(optimizer: torch.optim.Optimizer, runner) -> None:
    """`runner.optimizer(...)` made `optimizer`."""
    _MADE_BY[optimizer] = (weakref.ref(runner), f"the runner of plan '{runner.program.plan}' (rank {runner.rank})")


def check_made_here(runner, given: Sequence, *, action: str) -> None:
    """Each optimizer of `given` that some runner made was made by `runner`; otherwise a
    CheckpointError naming the one that made it (module doc). An optimizer made outside
    fxpar is left to `state`, which refuses one stepping another model's tensors."""
    for optimizer in given:
        maker, name = _MADE_BY.get(optimizer, (None, None))
        if maker is not None and maker() is not runner:
            raise CheckpointError(
                f"runner.{action}(optimizer=...) was given an optimizer ({type(inner_optimizer(optimizer)).__name__}) that "
                f"{name} made, not this runner (plan '{runner.program.plan}', rank {runner.rank}): it steps that "
                f"runner's tensors, so its state would be {'saved under' if action == 'save' else 'loaded into'} "
                f"the wrong ones. Fix: pass the optimizer this runner's runner.optimizer(...) made"
            )


def warn_unsaved(made: Iterable, given: Sequence | None, path: Path) -> None:
    """A UserWarning naming each optimizer of `made` (the runner's) that holds state and is
    not among `given` (the optimizers passed; None when none was): the save leaves its state
    out (module note). `given=[]`, the model alone on purpose, warns of none."""
    if given is not None and not given:
        return
    given = given or []
    left_out = [o for o in made if not any(o is g for g in given) and inner_optimizer(o).state]
    if not left_out:
        return
    described = "; ".join(_described(o) for o in left_out)
    fix = "optimizer=opt" if len(left_out) == 1 and not given else "optimizer=[...] listing every one"
    warnings.warn(
        f"fxpar: runner.save({str(path)!r}) leaves out the state of {described}, which runner.optimizer made: a "
        f"run resumed from this checkpoint would restart it from nothing. Fix: pass {fix} to save it, or "
        "optimizer=[] to save the model alone without this warning", stacklevel=3)


def warn_unread(manifest: dict, stored: Iterable[str], path: Path, *, prefix: str) -> None:
    """A UserWarning when a load without `optimizer=` leaves the checkpoint's optimizer state
    (the manifest's classes, the `prefix` keys of `stored`) unread."""
    saved = manifest.get("optimizer")
    saved = saved if isinstance(saved, list) else [] if saved is None else [saved]
    if not saved:
        return
    count = sum(1 for key in stored if key.startswith(prefix))
    classes = ", ".join(entry["class"] for entry in saved)
    warnings.warn(
        f"fxpar: runner.load({str(path)!r}) without optimizer= did not restore the checkpoint's optimizer state "
        f"({classes}: {count} tensors, '{prefix}*'): the optimizers keep what they hold (nothing, for new ones), "
        f"so training would restart their moments. Fix: runner.load(path, optimizer=...) with the "
        f"optimizer{'s' if len(saved) > 1 else ''} it was saved with, in the same order", stacklevel=4)


def _described(optimizer) -> str:
    inner = inner_optimizer(optimizer)
    tensors = sum(1 for state in inner.state.values() for value in state.values() if isinstance(value, torch.Tensor))
    return f"{type(inner).__name__} ({tensors} state tensors over {len(inner.state)} parameters or shards)"
