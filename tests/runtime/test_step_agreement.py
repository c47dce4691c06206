"""The step agreement in flight: settled before the next call that moves data, never later.

`runtime.step.agreement` starts each step's agreement on tp and pp without waiting for it;
the communicator settles it (`Communicator.settle_before_data`) before the first call that is
not itself an agreement, or at the end of the step. `test_failures.py` runs the multi-rank
case (a rank carries on after a failed step: every rank names both steps); here one process,
a world of one on a real gloo group, checks when the settling happens.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from fxpar.errors import StepMismatchError
from fxpar.ir.mesh import Axis
from fxpar.runtime.communicator import Communicator
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.step import numbers
from fxpar.runtime.step.agreement import start_agreement


@pytest.fixture
def group(world_of_one):
    return RankGroup(axis=Axis.TP, ranks=(0,), handle=world_of_one)


def test_an_agreement_settles_before_the_next_data_call_not_before_another_agreement(group):
    communicator, order = Communicator(timedelta(seconds=10)), []
    communicator.start_step()
    for name in ("pp", "tp"):
        settle = start_agreement(communicator, group, 3, tag=f"step agreement on {name}", device=torch.device("cpu"))
        communicator.settle_before_data(lambda settle=settle, name=name: order.append(name) or settle())
    assert order == []  # both in flight: an agreement does not wait for the one before it
    communicator.all_reduce_now(torch.ones(2), group, tag="g", phase="forward")
    assert order == ["pp", "tp"]  # both settled, in order, before the data call went out
    communicator.all_reduce_now(torch.ones(2), group, tag="g", phase="forward")
    assert order == ["pp", "tp"]  # once
    communicator.end_step()
    assert [call.tag for call in communicator.log] == [
        "step agreement on pp", "step agreement on tp", "g", "g"]


def test_an_agreement_left_unsettled_is_checked_at_the_end_of_the_step(group):
    communicator = Communicator(timedelta(seconds=10))
    communicator.start_step()
    settle = start_agreement(communicator, group, 3, tag="step agreement on tp", device=torch.device("cpu"))

    def mismatched() -> None:
        settle()
        raise StepMismatchError("rank 0 is on step 3, but ...")

    communicator.settle_before_data(mismatched)
    with pytest.raises(StepMismatchError):
        communicator.end_step()


def test_a_failed_step_leaves_its_agreement_to_complete_on_its_own(group):
    communicator, settled = Communicator(timedelta(seconds=10)), []
    communicator.start_step()
    settle = start_agreement(communicator, group, 3, tag="step agreement on tp", device=torch.device("cpu"))
    communicator.settle_before_data(lambda: settled.append(settle()))
    communicator.end_step(check=False)  # the step raised: its own error says what went wrong
    communicator.start_step()
    communicator.all_reduce_now(torch.ones(2), group, tag="g", phase="forward")
    assert settled == []  # the next step's data call does not settle the failed step's agreement


def test_step_numbers_riding_in_a_float_payload_are_exact_modulo_2_to_the_24():
    """A float32 slot holds a step number exactly below 2**24 (`runtime.step.numbers`)."""
    member = RankGroup(axis=Axis.TP, ranks=(0, 1), handle=None, rank=1)
    step = 2**24 + 5
    vector = numbers.slots(member, step, dtype=torch.float32, device=torch.device("cpu"))
    assert vector.tolist() == [0.0, 5.0]
    numbers.check(member, step, torch.tensor([5.0, 5.0]))  # both ranks on the step
    with pytest.raises(StepMismatchError, match="rank 1 is on step 16777221 .* rank 0 on step 16777220: "):
        numbers.check(member, step, torch.tensor([4.0, 5.0]))
