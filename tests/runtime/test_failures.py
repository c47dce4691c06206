"""Tier 3: a peer that stops communicating makes the others fail in bounded time, not hang."""

import pytest

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(
    "plan, what",
    [
        # The step's first collective: its first bucket, with the count and the step numbers.
        ("dp=2", "all_reduce of gradient bucket 0 + loss + valid targets + step"),
        # The step starts with the pipeline's ranks agreeing on the step: the stalled last
        # stage never joins (before this agreement existed, the first stage's first backward
        # waited for gradients it never sent; both go through the same timed wait).
        ("pp=2 mb=2", "all_reduce of step agreement on pp"),
    ],
)
def test_stalled_peer_fails_the_collective_within_the_timeout_naming_the_group(torchrun, plan, what):
    outcome, _ = torchrun("stall_worker.py", 2, plan, timeout=120)
    assert outcome["type"] == "CollectiveError"
    assert what in outcome["error"]
    assert ("dp group [0, 1]" if plan == "dp=2" else "pp group [0, 1]") in outcome["error"]
    assert "did not complete within 3 s" in outcome["error"]
    assert outcome["waited"] < 3 + 5  # the timeout plus scheduling slack on 2 busy cores


def test_an_edited_step_program_is_refused_by_check_and_stopped_by_the_runtime(torchrun):
    """Rank 1's step program lists bucket 0 with 7 elements: `check()` names the mismatch, and
    at run time rank 1's guard stops before the all-reduce (so nothing pairs wrongly), while
    rank 0 fails within its timeout naming the bucket (tests/test_step_program.py: in process)."""
    zero, one = torchrun("edited_worker.py", 2, timeout=120)
    for rank in (zero, one):
        assert "collective #0 on process group [0, 1] does not match" in rank["check"]
    assert one["type"] == "StepProgramError"
    assert "rank 1 was about to issue all_reduce" in one["error"] and "7 x torch.float32" in one["error"]
    assert zero["type"] == "CollectiveError" and "gradient bucket 0" in zero["error"]
    assert zero["waited"] < 3 + 5


def test_a_rank_that_carries_on_after_a_failed_step_is_stopped_naming_both_steps(torchrun):
    """Rank 1's second step raises before communicating (a bad batch) and it carries on to its
    third while rank 0 is in its second: the first collective of the step, on each axis, holds
    every rank's step number (`runtime.step.agreement`), so both ranks stop there, naming both
    steps, at once (no timeout), before the two steps' data is mixed."""
    plans = ("dp=2", "tp=2", "pp=2 mb=2")  # riding in dp's first bucket; tp's and pp's own calls
    zero, one = torchrun("skip_worker.py", 2, *plans, timeout=180)
    for plan, axis in zip(plans, ("dp", "tp", "pp")):
        assert zero[plan]["steps"] == one[plan]["steps"] == 1, plan
        assert "caught" in one[plan] and "caught" not in zero[plan]
        for rank, outcome, mine, theirs in ((zero, zero[plan], 2, 3), (one, one[plan], 3, 2)):
            assert outcome["type"] == "StepMismatchError", (plan, outcome)
            me, peer = (0, 1) if rank is zero else (1, 0)
            assert outcome["error"].startswith(
                f"rank {me} is on step {mine} (its call #{mine} of runner.step since bind), but on "
                f"the {axis} group [0, 1] rank {peer} on step {theirs}: the ranks are on different steps"
            ), outcome["error"]
            assert outcome["waited"] < 5  # the agreement completes: nothing waits for the 5 s timeout
