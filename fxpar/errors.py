"""The errors fxpar raises for things a user can fix.

Every message names what was wrong (a plan field and its value, a graph node and its module
path, a rank and its process group), the constraint it broke, and a fix. `assert` is kept for
fxpar's own invariants; these classes are for the user's input and environment.
"""

from __future__ import annotations

import reprlib


class FxparError(Exception):
    """Base class of every error fxpar raises on purpose."""


class PlanError(FxparError, ValueError):
    """A plan that is invalid on its own or does not fit the model, the batch or the world.

    Raised before any rank runs or any collective is issued. `field` and `value` name the plan
    entry at fault when there is one.
    """

    def __init__(self, message: str, *, field: str | None = None, value: object = None):
        super().__init__(message)
        self.field = field
        self.value = value


class BatchError(FxparError, ValueError):
    """A step's batch that does not fit the compiled program: a missing or extra input, a
    tensor of another rank, dtype, device or fixed size than the example's, an empty batch, a
    sequence longer than the model's positions, or a label outside the vocabulary.

    Raised by `runner.step` before the step issues any collective (`runtime.step.batch_checks`),
    naming the input as the example named it (its keyword, or `input i` and its parameter),
    what the program expects, what it got, and a fix.
    """


class CaptureError(FxparError, RuntimeError):
    """The model could not be captured as one graph; the message names the cause and module."""


class BindError(FxparError, RuntimeError):
    """A program could not be bound to this process: no torchrun environment, a device, a group."""


class CollectiveError(FxparError, RuntimeError):
    """A collective failed or did not complete within its process group's timeout."""


class CheckpointError(FxparError, RuntimeError):
    """A checkpoint that cannot be loaded here: missing or incomplete, of another model (a
    key missing, extra or of another shape), or holding something fxpar does not unpickle."""


class StepProgramError(CollectiveError):
    """A rank was about to issue a collective its step program does not list (or left one of
    its listed calls out): raised before the call is made, so no peer is paired with it."""


class StepMismatchError(CollectiveError):
    """The ranks of a group are on different steps (`runtime.step.agreement`): raised on every
    rank of the group at the step's first collective, naming both step numbers, before any of
    the step's data is reduced."""


class BatchMismatchError(CollectiveError):
    """The ranks of a group that must be given one batch (a tp group, a pipeline's stages)
    were given different ones (`runtime.step.batch_identity`): raised on every rank of the group at
    the step's agreement, naming the ranks and the inputs, before any of the step's data moves."""


class VerifyError(FxparError, RuntimeError):
    """`fxpar.verify` could not compare: a model it cannot run as given, or a parallel run that
    did not complete (each rank's error, or a timeout)."""


# -- showing the user's values in messages ---------------------------------------------------------

SHOWN_CHARACTERS = 80  # the most of one value a message echoes

_REPR = reprlib.Repr()
# reprlib stops at these sizes while it writes, so even a value whose full repr would be huge (a
# list holding itself through many references, a megabyte string) costs microseconds to show.
for _name in ("maxdict", "maxlist", "maxtuple", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_REPR, _name, 4)
_REPR.maxlevel, _REPR.maxlong = 3, 40
_REPR.maxstring = _REPR.maxother = SHOWN_CHARACTERS


def shown(value: object) -> str:
    """`repr(value)` for an error message, at most `SHOWN_CHARACTERS` characters.

    >>> shown("two"), len(shown("x" * 10_000)), shown(list(range(10**6)))
    ("'two'", 80, '[0, 1, 2, 3, ...]')
    """
    return clipped(_REPR.repr(value))


def clipped(text: str) -> str:
    """`text` cut to `SHOWN_CHARACTERS` characters, with its length said when it was cut."""
    if len(text) <= SHOWN_CHARACTERS:
        return text
    return f"{text[: SHOWN_CHARACTERS - 24]}… ({len(text):,} characters)"
