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
