"""Tier 3: a peer that stops communicating makes the others fail in bounded time, not hang."""

import pytest

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(
    "plan, what",
    [
        ("dp=2", "all_reduce of valid targets"),  # the step's first collective
        # The first stage's first backward waits for gradients the stalled last stage never sends.
        ("pp=2 mb=2", "recv of stage 0 gradients"),
    ],
)
def test_stalled_peer_fails_the_collective_within_the_timeout_naming_the_group(torchrun, plan, what):
    outcome, _ = torchrun("stall_worker.py", 2, plan, timeout=120)
    assert outcome["type"] == "CollectiveError"
    assert what in outcome["error"]
    assert ("dp group [0, 1]" if plan == "dp=2" else "point-to-point group [0, 1]") in outcome["error"]
    assert "did not complete within 3 s" in outcome["error"]
    assert outcome["waited"] < 3 + 5  # the timeout plus scheduling slack on 2 busy cores


def test_an_edited_step_program_is_refused_by_check_and_stopped_by_the_runtime(torchrun):
    """Rank 1's step program lists bucket 0 with 7 elements: `check()` names the mismatch, and
    at run time rank 1's guard stops before the all-reduce (so nothing pairs wrongly), while
    rank 0 fails within its timeout naming the bucket (tests/test_step_program.py: in process)."""
    zero, one = torchrun("edited_worker.py", 2, timeout=120)
    for rank in (zero, one):
        assert "collective #1 on process group [0, 1] does not match" in rank["check"]
    assert one["type"] == "StepProgramError"
    assert "rank 1 was about to issue all_reduce" in one["error"] and "7 x torch.float32" in one["error"]
    assert zero["type"] == "CollectiveError" and "gradient bucket 0" in zero["error"]
    assert zero["waited"] < 3 + 5
