"""Tier 1: gradient buckets follow the graph's exact gradient-ready order."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.frontend.trace import capture
from fxpar.ir import meta
from fxpar.passes.data_parallel import assign_gradient_buckets
from fxpar.passes.infra import run_passes


class _Chain(nn.Module):
    """a -> b -> c, a frozen layer, an unused layer, and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx, targets):
        h = self.c(self.frozen(self.b(self.a(self.embed(idx)))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def buckets_of(bucket_bytes: int):
    idx, targets = torch.randint(0, 16, (2, 3)), torch.randint(0, 16, (2, 3))
    captured = capture(_Chain(), (idx, targets))
    gm = run_passes(captured.graph_module, [lambda g: assign_gradient_buckets(g, bucket_bytes=bucket_bytes)])
    return gm, meta.graph_buckets(gm)


def test_one_parameter_per_bucket_lists_reverse_first_use_order():
    _, buckets = buckets_of(bucket_bytes=1)
    order = [name for bucket in buckets for name in bucket.parameters]
    # The embedding is used first in forward (and again by the tied head), so its gradient is
    # complete last; frozen and unused parameters get no bucket. A weight and its bias come
    # from one backward node, which hands out the bias gradient first.
    assert order == ["c.bias", "c.weight", "b.bias", "b.weight", "a.bias", "a.weight", "embed.weight"]
    assert [b.index for b in buckets] == list(range(7))


def test_buckets_close_once_they_reach_the_size():
    _, buckets = buckets_of(bucket_bytes=300)  # weights 256 B, biases 32 B, embedding 512 B
    assert [b.parameters for b in buckets] == [
        ("c.bias", "c.weight", "b.bias"), ("b.weight", "a.bias", "a.weight"), ("embed.weight",)
    ]
    assert [b.nbytes for b in buckets] == [320, 544, 512]


def test_bucket_index_is_on_each_parameter_node():
    gm, buckets = buckets_of(bucket_bytes=10**9)
    assert len(buckets) == 1
    nodes = meta.parameter_nodes(gm.graph)
    assert {n: node.meta.get(meta.BUCKET) for n, node in nodes.items()} == {
        "embed.weight": 0, "a.weight": 0, "a.bias": 0, "b.weight": 0, "b.bias": 0,
        "c.weight": 0, "c.bias": 0, "frozen.weight": None, "frozen.bias": None,
        "unused.weight": None, "unused.bias": None,
    }
