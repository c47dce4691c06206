"""The ranks of a tp group or a pipeline hold one batch, or every one of them says which differ.

`runtime.step.batch_identity`: each rank's step agreement on tp and pp carries a fingerprint of its
batch and the batch's sizes, in a call of one size whatever the batch. The fingerprint's
properties are checked here in one process; the multi-rank launch gives rank 1 other rows (a
loader sharded by global rank: before, tp trained silently to another loss) or fewer rows
(before, gloo aborted the process in its C++ at the first collective).
"""

from __future__ import annotations

import pytest
import torch

from fxpar.errors import BatchMismatchError
from fxpar.ir.mesh import Axis
from fxpar.runtime.process_groups import RankGroup
from fxpar.runtime.step.batch_identity import BatchIdentity

CPU = torch.device("cpu")
TOKENS = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
LABELS = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))


def identity(*inputs: torch.Tensor, microbatches: int = 1) -> BatchIdentity:
    return BatchIdentity.of(list(zip(*(t.tensor_split(microbatches) for t in inputs))), CPU)


def fingerprint(*inputs: torch.Tensor, microbatches: int = 1) -> int:
    return int(identity(*inputs, microbatches=microbatches).block[0])


def test_the_fingerprint_is_of_the_values_their_order_and_the_inputs_order():
    base = fingerprint(TOKENS, LABELS)
    assert base == fingerprint(TOKENS.clone(), LABELS.clone())
    assert identity(TOKENS, LABELS, microbatches=2).block.tolist() == identity(TOKENS, LABELS).block.tolist()
    one_token = TOKENS.clone()
    one_token[5, 7] += 1
    assert fingerprint(one_token, LABELS) != base
    assert fingerprint(TOKENS[[1, 0, *range(2, 8)]], LABELS) != base  # two rows swapped
    assert fingerprint(LABELS, TOKENS) != base  # the inputs swapped
    floats = torch.zeros(4, 3)
    assert fingerprint(floats) != fingerprint(-floats)  # the bits: -0.0 is not 0.0
    assert identity(TOKENS, LABELS).block.tolist()[1:] == [8, 16, 8, 16]


def test_a_member_with_another_block_is_named_with_both_shapes():
    member = RankGroup(axis=Axis.TP, ranks=(0, 1), handle=None, rank=0)
    mine, theirs = identity(TOKENS, LABELS), identity(TOKENS[:4], LABELS[:4])
    mine.check(member, torch.cat((mine.block, mine.block)), ("idx", "targets"))
    with pytest.raises(BatchMismatchError, match=r"rank 0 and rank 1 of the tp group \[0, 1\] were given "
                       r"different batches: their shapes differ \(idx of shape \(4, 16\) on rank 1, "
                       r"\(8, 16\) on rank 0; targets"):
        mine.check(member, torch.cat((mine.block, theirs.block)), ("idx", "targets"))


@pytest.fixture(scope="module")
def outcomes(module_torchrun):
    cases = ("tp=2:rows", "tp=2:shape", "pp=2 mb=2:rows", "pp=2 mb=2:shape")
    return module_torchrun("batch_agreement_worker.py", 2, *cases, timeout=240)


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["tp=2:rows", "tp=2:shape", "pp=2 mb=2:rows", "pp=2 mb=2:shape"])
def test_ranks_given_different_batches_all_stop_naming_each_other(outcomes, case):
    axis = case[:2]
    for me, peer in ((0, 1), (1, 0)):
        outcome = outcomes[me][case]
        assert outcome["steps"] == 1 and outcome["type"] == "BatchMismatchError", outcome
        assert outcome["error"].startswith(
            f"rank {me} and rank {peer} of the {axis} group [0, 1] were given different batches: "), outcome
        if case.endswith("shape"):  # each rank names the peer's shape first
            peer_shape, my_shape = ((4, 16), (8, 16)) if me == 0 else ((8, 16), (4, 16))
            assert f"idx of shape {peer_shape} on rank {peer}, {my_shape} on rank {me}" in outcome["error"]
        else:
            assert "the shapes agree but the values differ" in outcome["error"]
        assert outcome["waited"] < 5  # the agreement completed: nothing waited for the 5 s timeout
