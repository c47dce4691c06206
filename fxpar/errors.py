"""The errors fxpar raises for things a user can fix.

Every message names what was wrong (a plan field and its value, a graph node and its module
path, a rank and its process group), the constraint it broke, and a fix. `assert` is kept for
fxpar's own invariants; these classes are for the user's input and environment.
"""

from __future__ import annotations


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


class CaptureError(FxparError, RuntimeError):
    """The model could not be captured as one graph; the message names the cause and module."""


class BindError(FxparError, RuntimeError):
    """A program could not be bound to this process: no torchrun environment, a device, a group."""


class CollectiveError(FxparError, RuntimeError):
    """A collective failed or did not complete within its process group's timeout."""


class StepProgramError(CollectiveError):
    """A rank was about to issue a collective its step program does not list (or left one of
    its listed calls out): raised before the call is made, so no peer is paired with it."""
