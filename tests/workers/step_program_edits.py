"""Step programs edited by hand: what the tests hand the check and the runtime to show both
refuse a program whose ranks would not pair up (a call dropped, resized, actions swapped).

    from step_program_edits import drop_call
    program.replace_step_program(0, drop_call(program.step_program(0), 3))
"""

from __future__ import annotations

from dataclasses import replace

from fxpar.ir.step_program import StepAction, Call, Exchange, StepProgram


def drop_call(program: StepProgram, position: int) -> StepProgram:
    """`program` without its `position`-th call (in `calls()` order): for tests that show the
    check and the runtime both see an edited program."""
    return _edit_call(program, position, lambda call: None)


def resize_call(program: StepProgram, position: int, numel: int) -> StepProgram:
    """`program` with its `position`-th call's payload set to `numel` elements."""
    return _edit_call(program, position, lambda call: replace(call, numel=numel))


def swap_actions(program: StepProgram, first: int, second: int) -> StepProgram:
    """`program` with its actions at positions `first` and `second` exchanged."""
    actions = list(program.actions)
    actions[first], actions[second] = actions[second], actions[first]
    return program.replace_actions(actions)


def _edit_call(program: StepProgram, position: int, edit) -> StepProgram:
    actions, seen = [], 0
    for action in program.actions:
        calls = action.calls
        if seen <= position < seen + len(calls):
            actions.append(_with_call(action, position - seen, edit))
        else:
            actions.append(action)
        seen += len(calls)
    if position >= seen:
        raise IndexError(f"the step program of rank {program.rank} has {seen} calls, not {position + 1}")
    return program.replace_actions(actions)


def _with_call(action: StepAction, index: int, edit) -> StepAction:
    def edited(calls: tuple[Call, ...], i: int) -> tuple[Call, ...]:
        new = edit(calls[i])
        return (*calls[:i], *([new] if new is not None else []), *calls[i + 1:])

    if isinstance(action, Exchange):
        if index < len(action.sends):
            return replace(action, sends=edited(action.sends, index))
        index -= len(action.sends)
        receives = list(action.receives)
        for j, receive in enumerate(receives):
            if index < len(receive.calls):
                receives[j] = replace(receive, calls=edited(receive.calls, index))
                return replace(action, receives=tuple(receives))
            index -= len(receive.calls)
    return replace(action, calls=edited(action.calls, index))
