"""Where every random value of a step comes from: one seed, and the slice of the value drawn.

A dropout mask (or any value the graph draws, `fxpar.ops.random_ops`) is drawn from a generator
of its own, whose seed is a function of

    seed         one per job: rank 0's, agreed at bind (`Runner`); never each process's own
    step         how many steps the runner has taken
    op_index     the random op's position among the captured graph's random ops (one device's
                 order, the same on every rank and every pipeline stage)
    the slice    which piece of the global value this rank holds: its coordinate on each mesh
                 axis its placement shards the value over, and the microbatch when the batch
                 is split

and of nothing else: not of the process, its global generator or what it drew before. This is
Megatron-LM's model-parallel RNG tracker (`tensor_parallel/random.py`:
`model_parallel_cuda_manual_seed` seeds a "model-parallel" stream with `seed + 2718 + tp_rank`
for dropout on tp-sharded activations, and keeps the default stream, equal on tp ranks, for
dropout on replicated ones), with the choice of stream read from the value's placement
(`fxpar.ir.placement`) instead of written by the model author, one region at a time:

    residual dropout after a row-parallel linear's all-reduce   Placements(dp=S(0), tp=R)
        same mask on every tp rank (their copies stay equal), differs across dp replicas
    attention-probability dropout over tp-sharded heads           Placements(dp=S(0), tp=S(1))
        a different mask on every tp rank and every dp replica
    any of them, microbatch m                                     differs across microbatches

`rng=fast` (the default) draws only this rank's piece, from `stream_seed(seed, step, op,
slice)` (a value nothing splits, as on one device, is drawn whole: `stream_seed(seed, step,
op)`, as rng=exact draws it). `rng=exact` draws the *whole* value, as one device does with the whole global batch,
from `stream_seed(seed, step, op)` alone, and keeps this rank's slice (`exact_piece`): every
rank then holds exactly one device's values, at the price of drawing dp x microbatches x (tp,
where the value is tp-sharded) times the elements (the cost model prices it: `cost.ops`).

A recomputed op (activation checkpointing) gets the same values, since the generator is made
from the same five facts again: the executors set the microbatch before each compute action,
backward included (`RandomStream.at`).

`RandomStream` is the running state the ops read: bound once per process, as the mesh axes are
(`fxpar.ir.axes`; torch's own default generator is process-wide too). `Runner.rng_state()` is
what a checkpoint saves to resume the same stream: the seed and the step.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from fxpar.errors import BindError

_SEED_BITS = 63  # torch.Generator.manual_seed takes any int64; keep it non-negative


def stream_seed(seed: int, step: int, op_index: int, *, microbatch: int | None = None,
                coords: Mapping[str, int] | None = None) -> int:
    """The seed of the generator one random op draws from (module doc): a hash of the job's
    seed, the step, the op and the slice (`microbatch`, and the mesh `coords` of the axes the
    value is sharded over; None / empty where nothing is split). The same on every process
    and every run; the slice's facts are named, so `coords={"tp": 0}` never meets
    `microbatch=0`."""
    facts = [("seed", seed), ("step", step), ("op", op_index)]
    if microbatch is not None:
        facts.append(("microbatch", microbatch))
    facts += sorted((coords or {}).items())
    text = ";".join(f"{name}={int(value)}" for name, value in facts).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] >> (64 - _SEED_BITS)


@dataclass
class RandomStream:
    """The running facts a step's random ops read: the job's seed, the step, and the
    microbatch being computed."""

    seed: int
    step: int = 0
    microbatch: int = 0

    @contextmanager
    def at(self, microbatch: int) -> Iterator[None]:
        """Compute microbatch `microbatch`'s actions (forward, backward and any recompute)."""
        self.microbatch = microbatch
        yield

    def state(self) -> dict[str, int]:
        """What resumes this stream: `{"seed": ..., "step": ...}` (a checkpoint saves it)."""
        return {"seed": self.seed, "step": self.step}

    def load_state(self, state: Mapping[str, int]) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])


_bound: list[RandomStream] = []  # at most one: see the module doc for why this is process-wide


def bind_random(stream: RandomStream) -> None:
    """Make `stream` the one this process's random ops draw from (replacing any other)."""
    _bound[:] = [stream]


def unbind_random(stream: RandomStream | None = None) -> None:
    """Forget the stream; given `stream`, only while it is the one bound."""
    if stream is None or (_bound and _bound[0] is stream):
        _bound.clear()


def bound_random() -> RandomStream:
    """The bound stream; BindError when none is (the program was not bound here)."""
    if not _bound:
        raise BindError(
            "a rank module draws random values (dropout), and no random stream is bound in "
            "this process. Fix: run it through `program.bind()` inside torchrun (or bind one "
            "with fxpar.ops.random_streams.bind_random for a test)"
        )
    return _bound[0]
