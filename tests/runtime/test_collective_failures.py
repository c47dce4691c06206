"""Tier 1: what a failed collective says, from backend errors as gloo writes them. No processes."""

from datetime import timedelta

import pytest

from fxpar.runtime.collective_failures import backend_text, describe_failure, peer_rank

GONE = RuntimeError(
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:4846. This is typically caused by a remote worker crashing."
)
STALLED = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms "
    "for recv operation to complete"
)
THIRTY = timedelta(seconds=30)


def test_a_peer_gone_early_is_not_reported_as_a_timeout():
    message = describe_failure(GONE, ranks=(0, 1), rank=0, waited=0.05, timeout=THIRTY)
    assert message.startswith(
        "failed after 0.05 s, well before its 30 s timeout: rank 1 is gone (its connection was "
        "closed or refused"
    )
    assert "did not complete within" not in message
    assert message.endswith("RuntimeError: Connection closed by peer [127.0.0.1]:4846. This is "
                            "typically caused by a remote worker crashing.")  # no source path


def test_a_timeout_says_how_long_it_waited():
    message = describe_failure(STALLED, ranks=(0, 1), rank=1, waited=3.01, timeout=timedelta(seconds=3))
    assert message.startswith("did not complete within 3 s (waited 3.0 s): a peer rank never joined")


@pytest.mark.parametrize(
    ("text", "ranks", "rank", "peer"),
    [
        ("Connection closed by peer [127.0.0.1]:4846", (0, 1), 0, 1),  # two ranks: the other one
        ("Connection closed by peer [127.0.0.1]:4846", (2, 3), 3, 2),
        ("Connection closed by peer [127.0.0.1]:4846", (0, 1, 2, 3), 0, None),  # an address only
        ("failed to receive from rank 2: Connection reset", (0, 1, 2, 3), 0, 2),
        ("[Rank 0] Timed out waiting 3000ms", (0, 1, 2, 3), 0, None),  # names itself, not a peer
        ("Timed out waiting 3000ms for recv operation", (0, 1), 0, None),  # a stall: no one is gone
        ("peer rank 7 closed", (0, 1), 0, None),  # not in this group: not believed
    ],
)
def test_the_peer_is_named_only_when_certain(text, ranks, rank, peer):
    assert peer_rank(text, ranks=ranks, rank=rank) == peer


def test_backend_text_is_one_bounded_line():
    text = backend_text(RuntimeError("first line\n  second [a/b/c.cpp:12] line " + "x" * 1000))
    assert "\n" not in text and "c.cpp" not in text and len(text) <= 401
