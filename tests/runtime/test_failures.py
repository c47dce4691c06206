"""Tier 3: a peer that stops communicating makes the others fail in bounded time, not hang."""

import pytest

pytestmark = pytest.mark.multirank


def test_stalled_peer_fails_the_collective_within_the_timeout_naming_the_group(torchrun):
    outcome, _ = torchrun("stall_worker.py", 2, timeout=120)
    assert outcome["type"] == "CollectiveError"
    assert "dp group [0, 1]" in outcome["error"]
    assert "did not complete within 3 s" in outcome["error"]
    assert outcome["waited"] < 3 + 5  # the timeout plus scheduling slack on 2 busy cores
