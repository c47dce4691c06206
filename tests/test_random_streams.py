"""Randomness drawn by slice (fxpar.ops.random_streams, fxpar.ops.random_ops), in one process: the
seed derivation, the slices rng=exact keeps, what rng=fast makes equal and different, and a
compiled module's draws across steps and recomputes (the pass: tests/passes/test_random_draws.py).

Ranks are played in this process by binding the mesh axes to plain objects with an index
(`fxpar.ir.axes.bind_axes`): a draw communicates nothing, so its value on rank (dp=i, tp=j) is the
op's value with those indices bound. Masks are compared exactly: the same generator state
gives the same bits.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.errors import BindError
from fxpar.ir.axes import bind_axes, unbind_axes
from fxpar.ops.random_ops import DrawSlice
from fxpar.ops.random_streams import RandomStream, bind_random, stream_seed, unbind_random

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from tiny_training import GPT, GPTConfig, global_batches  # noqa: E402

random_like = torch.ops.fxpar.random_like.default
attention_mask = torch.ops.fxpar.attention_dropout_mask.default
DROPOUT = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


@dataclass
class Coordinate:
    size: int
    index: int


@pytest.fixture
def stream():
    stream = RandomStream(seed=7)
    bind_random(stream)
    yield stream
    unbind_random()
    unbind_axes()


def on_rank(stream: RandomStream, op, *args, dp=(1, 0), tp=(1, 0), microbatch=0):
    """The op's value on the rank at `dp` = (size, index), `tp` = (size, index), microbatch."""
    bind_axes({"dp": Coordinate(*dp), "tp": Coordinate(*tp)})
    stream.microbatch = microbatch
    return op(*args)


# -- the seed ------------------------------------------------------------------------------------

def test_the_seed_is_a_function_of_every_fact_and_of_nothing_else():
    base = stream_seed(1, 2, 3, microbatch=0, coords={"dp": 1, "tp": 0})
    assert base == stream_seed(1, 2, 3, microbatch=0, coords={"tp": 0, "dp": 1})  # order-free
    assert 0 <= base < 2**63
    others = {
        stream_seed(9, 2, 3, microbatch=0, coords={"dp": 1, "tp": 0}),
        stream_seed(1, 9, 3, microbatch=0, coords={"dp": 1, "tp": 0}),
        stream_seed(1, 2, 9, microbatch=0, coords={"dp": 1, "tp": 0}),
        stream_seed(1, 2, 3, microbatch=1, coords={"dp": 1, "tp": 0}),
        stream_seed(1, 2, 3, microbatch=0, coords={"dp": 0, "tp": 0}),
        stream_seed(1, 2, 3, microbatch=0, coords={"dp": 1, "tp": 1}),
        stream_seed(1, 2, 3, microbatch=0, coords={"dp": 1}),  # not split over tp
        stream_seed(1, 2, 3, coords={"dp": 1, "tp": 0}),  # no microbatch split
    }
    assert base not in others and len(others) == 8
    # Facts are named: a tp coordinate is not a microbatch of the same number.
    assert stream_seed(1, 2, 3, coords={"tp": 0}) != stream_seed(1, 2, 3, microbatch=0)


def test_a_draw_needs_a_bound_stream():
    unbind_random()
    with pytest.raises(BindError, match="no random stream is bound"):
        random_like(torch.ones(2), "uniform", 0.0, 0, False, *DrawSlice().args)


# -- rng=exact: every rank holds its slice of one device's draw ----------------------------------

@pytest.mark.parametrize("tp_dim, tp_parts", [(1, 1), (2, 1), (2, 3)])  # heads, hidden, fused q|k|v
def test_exact_pieces_tile_the_one_device_draw(stream, tp_dim, tp_parts):
    dp, mb, tp = 2, 2, 2
    whole = torch.empty(8, 4, 12)  # the global batch of 8
    one_device = on_rank(stream, random_like, whole, "dropout", 0.25, 3, True, *DrawSlice(dp_dim=0).args)
    local = torch.empty(8 // (dp * mb), *(s // tp if d + 1 == tp_dim else s for d, s in enumerate(whole.shape[1:])))
    where = DrawSlice(dp_dim=0, dp_size=dp, microbatches=mb, tp_dim=tp_dim, tp_parts=tp_parts, tp_size=tp)
    rows = []
    for i in range(dp):
        for m in range(mb):
            pieces = [on_rank(stream, random_like, local, "dropout", 0.25, 3, True, *where.args,
                              dp=(dp, i), tp=(tp, j), microbatch=m) for j in range(tp)]
            rows.append(fxpar.ir.placement.global_tensor(pieces, fxpar.ir.placement.Shard(tp_dim, tp_parts)))
    assert torch.equal(torch.cat(rows), one_device)
    kept = (one_device > 0).float().mean().item()
    assert one_device.unique().tolist() == [0.0, torch.tensor(1 / 0.75).item()] and 0.65 < kept < 0.85


def test_exact_attention_mask_over_sharded_heads_is_one_devices(stream):
    q, k = torch.empty(4, 4, 6, 8), torch.empty(4, 4, 6, 8)  # (batch, heads, seq, head dim)
    one_device = on_rank(stream, attention_mask, q, k, 0.5, 1, True, *DrawSlice(dp_dim=0).args)
    assert one_device.shape == (4, 4, 6, 6) and one_device.dtype == torch.bool
    where = DrawSlice(dp_dim=0, dp_size=2, tp_dim=1, tp_size=2)
    q_local, k_local = q[:2, :2], k[:2, :2]
    for i in range(2):
        for j in range(2):
            piece = on_rank(stream, attention_mask, q_local, k_local, 0.5, 1, True, *where.args, dp=(2, i), tp=(2, j))
            assert torch.equal(piece, one_device[2 * i:2 * i + 2, 2 * j:2 * j + 2])


def test_exact_replicated_value_is_the_same_for_every_microbatch_as_on_one_device(stream):
    weight = torch.empty(5, 3)  # no batch dim: one device draws one mask for the whole batch
    one_device = on_rank(stream, random_like, weight, "bernoulli_p", 0.5, 0, True, *DrawSlice().args)
    for m in range(2):
        piece = on_rank(stream, random_like, weight, "bernoulli_p", 0.5, 0, True,
                        *DrawSlice(dp_size=2, microbatches=2).args, dp=(2, 1), microbatch=m)
        assert torch.equal(piece, one_device)


# -- rng=fast: equal where the value is replicated, different where it is split ------------------

def test_fast_masks_follow_the_placement(stream):
    x = torch.empty(4, 6, 8)
    replicated_on_tp = DrawSlice(dp_dim=0, dp_size=2, microbatches=2, tp_size=2)  # residual dropout
    heads_on_tp = DrawSlice(dp_dim=0, dp_size=2, microbatches=2, tp_dim=1, tp_size=2)  # attention probs

    def mask(where, **rank):
        return on_rank(stream, random_like, x, "dropout", 0.5, 2, False, *where.args, **rank)

    base = mask(replicated_on_tp, dp=(2, 0), tp=(2, 0))
    assert torch.equal(base, mask(replicated_on_tp, dp=(2, 0), tp=(2, 1)))  # tp peers: same
    assert not torch.equal(base, mask(replicated_on_tp, dp=(2, 1), tp=(2, 0)))  # dp replicas: differ
    assert not torch.equal(base, mask(replicated_on_tp, dp=(2, 0), tp=(2, 0), microbatch=1))
    sharded = mask(heads_on_tp, dp=(2, 0), tp=(2, 0))
    assert not torch.equal(sharded, mask(heads_on_tp, dp=(2, 0), tp=(2, 1)))  # sharded slices: differ
    assert torch.equal(base, mask(replicated_on_tp, dp=(2, 0), tp=(2, 0)))  # reproducible
    stream.step += 1
    assert not torch.equal(base, mask(replicated_on_tp, dp=(2, 0), tp=(2, 0)))  # every step anew
    stream.step -= 1
    torch.manual_seed(12345)  # the process's own generator plays no part
    assert torch.equal(base, mask(replicated_on_tp, dp=(2, 0), tp=(2, 0)))


def test_one_device_draws_alike_under_fast_and_exact(stream):
    x = torch.empty(4, 6, 8)
    whole = DrawSlice(dp_dim=0, tp_dim=1)  # one rank, one microbatch: nothing splits it
    fast = on_rank(stream, random_like, x, "dropout", 0.5, 2, False, *whole.args)
    assert torch.equal(fast, on_rank(stream, random_like, x, "dropout", 0.5, 2, True, *whole.args))
    split = DrawSlice(dp_dim=0, microbatches=2)  # two microbatches: fast draws each its own
    assert not torch.equal(on_rank(stream, random_like, x, "dropout", 0.5, 2, False, *split.args),
                           on_rank(stream, random_like, x, "dropout", 0.5, 2, True, *split.args))


def test_the_other_distributions(stream):
    x = torch.full((2000,), 0.25)
    args = (0, False, *DrawSlice().args)
    uniform = on_rank(stream, random_like, x, "uniform", 0.0, *args)
    normal = on_rank(stream, random_like, x, "normal", 0.0, *args)
    bernoulli = on_rank(stream, random_like, x, "bernoulli", 0.0, *args)
    assert 0 <= uniform.min() and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.05
    assert abs(normal.mean()) < 0.1 and abs(normal.std() - 1) < 0.1
    assert torch.equal(bernoulli, (uniform < 0.25).float())  # one uniform draw decides each

# -- a compiled module's draws ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_example():
    torch.manual_seed(0)
    tokens, labels = global_batches()[0]
    return fxpar.capture(GPT(DROPOUT), (tokens, labels))


def test_one_device_exact_training_by_hand_draws_fresh_masks_each_step(gpt_example, stream):
    program = fxpar.compile(gpt_example, "rng=exact")
    module, count = program.rank_module(0), program.loss_reduction.count_module
    tokens, labels = global_batches()[0]
    inputs = (tokens, labels, count(tokens, labels).to(program.loss_reduction.count_dtype))
    first = module(*inputs).item()
    assert module(*inputs).item() == first  # same step: the same masks
    stream.step += 1
    assert module(*inputs).item() != first


def test_a_recompute_draws_what_its_forward_drew(gpt_example, stream):
    """Activation checkpointing: torch.utils.checkpoint runs the forward again in backward;
    the draws' generators are made again from the same facts (the executors set the
    microbatch for the B action too), so the gradients are the uncheckpointed ones, bit for
    bit, whatever the process's generator did in between."""
    program = fxpar.compile(gpt_example, "dp=1 mb=2")
    module, count = program.rank_module(0), program.loss_reduction.count_module
    tokens, labels = global_batches()[0]
    inputs = (tokens, labels, count(tokens, labels).to(program.loss_reduction.count_dtype))

    def gradients(run, backward_microbatch=1):
        module.zero_grad()
        with stream.at(1):
            loss = run()
        torch.manual_seed(999)
        with stream.at(backward_microbatch):
            loss.backward()
        return [p.grad.clone() for p in module.parameters()]

    plain = gradients(lambda: module(*inputs))
    checkpointed = gradients(lambda: torch.utils.checkpoint.checkpoint(module, *inputs, use_reentrant=False))
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
    # What makes it so: a recompute under another microbatch draws other masks.
    elsewhere = gradients(lambda: torch.utils.checkpoint.checkpoint(module, *inputs, use_reentrant=False),
                          backward_microbatch=0)
    assert not all(torch.equal(a, b) for a, b in zip(plain, elsewhere))
