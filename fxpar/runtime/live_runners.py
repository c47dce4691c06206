"""The runners bound in this process, and what a second `bind()` and a `close()` may do.

A runner is *live* from `program.bind()` until `close()`. While live it owns what bind set up
on its parameters: one post-accumulate-grad hook per parameter (`runtime.state.gradient_buckets`),
which all-reduces its bucket as soon as backward has filled it. The rules:

1. **One live runner per parameter.** Binding a program whose parameters a live runner already
   trains is a BindError: the same program bound twice, or another program compiled from the
   same model (`fxpar.compile` copies nothing: a program's replicated parameters are the
   model's own tensors). A second set of hooks would launch its own all-reduces from every
   backward of the first runner, so both would train on corrupted gradients.
2. **Programs of different models may be live together**, bound one after the other in one
   process (the benchmarks compare several that way); they share the process groups the first
   bind created.
3. **`close()` ends every live runner of the process.** The process groups belong to the
   process, and all live runners use them; close destroys them, so it closes the others too.
   A closed runner refuses to train (`step`, `optimizer`, `full_state_dict`, ...) with a
   BindError that says which close ended it; what it counted (`comm_stats`, `comm_log`)
   can still be read. Closing twice is harmless.
4. **After close, bind again**: new groups, new hooks, on the same or another program.
5. A runner dropped without close is ended when Python collects it: its hooks go with it
   (`weakref.finalize`), so its parameters can be bound again.
6. **A script that ends without close is closed at exit** (`atexit`): a gloo group left alive
   into interpreter teardown can abort the process there ("terminate called without an
   active exception", seen on a rank that saved a checkpoint and returned).

    runner = program.bind()
    program.bind()                   # BindError: program already bound, runner is live
    runner.close()
    runner.step(tokens, labels)      # BindError: this runner was closed
    runner = program.bind()          # fine: a new runner
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch.fx as fx

from fxpar.errors import BindError
from fxpar.ir.compiled_program import CompiledProgram


class Runner(Protocol):
    """What this module reads of a `runtime.runner.Runner` (which imports this module)."""

    program: CompiledProgram
    rank: int
    modules: Sequence[fx.GraphModule]

    def close(self) -> None: ...


_live: weakref.WeakSet[Runner] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Rule 6: one live runner's close ends them all and destroys the process groups."""
    for runner in list(_live)[:1]:
        runner.close()


def check_can_bind(program: CompiledProgram) -> None:
    """BindError if a live runner trains any of `program`'s parameters (rule 1)."""
    conflict = _conflict(program)
    if conflict is not None:
        gc.collect()  # a runner nobody references any more is not live: let Python end it
        conflict = _conflict(program)
    if conflict is None:
        return
    runner, name = conflict
    if runner.program is program:
        raise BindError(
            f"program.bind() was already called on this program in this process, and that "
            f"runner (plan '{program.plan}', rank {runner.rank}) is still live: a second runner "
            "would put a second set of gradient hooks on the same parameters, and each would "
            "all-reduce the other's gradients. Fix: keep using the first runner, or call "
            "runner.close() on every rank before binding again"
        )
    raise BindError(
        f"parameter {name!r} of this program (plan '{program.plan}') is trained by a live "
        f"runner of another program (plan '{runner.program.plan}'), bound earlier in this "
        "process: both were compiled from the same model, and fxpar.compile copies nothing, so "
        "their hooks would fire on each other's backward. Fix: runner.close() the other one "
        "first (on every rank), or compile a copy of the model (copy.deepcopy(model)) for the "
        "second program"
    )


def register(runner: Runner, release: Callable[[], None]) -> None:
    """Count `runner` live; `release` (removing its hooks) runs if it is dropped unclosed."""
    _live.add(runner)
    weakref.finalize(runner, release)


def end_all() -> list[Runner]:
    """Every live runner, no longer counted live (rule 3): the caller ends each."""
    runners = list(_live)
    _live.clear()
    return runners


def _conflict(program: CompiledProgram) -> tuple[Runner, str] | None:
    """A live runner that trains one of `program`'s parameters, and that parameter's name.

    The program's parameters are its capture's, the model's own tensors; a tensor-parallel
    runner's shards are copies, but its replicated parameters (norms, biases) are the model's.
    """
    mine = {id(p): name for name, p in program.captured.parameters.items()}
    for runner in list(_live):
        for parameter in (p for module in runner.modules for p in module.parameters()):
            if id(parameter) in mine:
                return runner, mine[id(parameter)]
    return None
