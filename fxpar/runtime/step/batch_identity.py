"""The batch's identity: what the ranks of a tp or pp group compare to prove they hold one batch.

The ranks of a tensor-parallel group compute one model split across them, and the stages of
a pipeline one model cut across them: each must be given the same batch. A data loader
sharded by global rank instead of by data-parallel rank gives them different rows, and
nothing fails: tp sums partial results of different rows, a pipeline's last stage scores
one batch's activations against another batch's labels, and the job trains silently to
another loss. Different row or sequence counts are worse: the first collective has a
different size on each rank, which gloo aborts on (`gloo::EnforceNotMet`) and NCCL may hang.

So each rank's step agreement on tp and pp (`runtime.step.agreement`, the first call of the
step on the axis, of a fixed size, settled before any call that moves the step's data)
carries, after the members' step numbers, one block per member:

    [fingerprint, size of input 0 dim 0, size of input 0 dim 1, ..., size of input k dim j]

each member writing its own block and zeros in the others', so after the sum every member
holds every member's block exactly (the step numbers' trick, `runtime.step.numbers`). The
block's length is fixed at compile time (`lowering.step_start_actions`: one fingerprint and
one slot per dim of the compiled inputs), so the call has the same size on every rank
whatever batch each was given, and a mismatch of shapes is caught before any collective
whose size depends on them. A rank whose block differs from another's raises
BatchMismatchError naming the group, the ranks and the inputs, on every member at once.

The fingerprint is a weighted sum of the batch's bits modulo the Mersenne prime
M = 2**31 - 1: the inputs' words (a view of their bits, at most 32 each, so float inputs are
compared exactly), word i weighted by w_i = (i + 1) * c mod M, each product reduced before
the sum so no int64 overflows (products < 2**62, sums of up to 2**32 of them < 2**63).
Each word is first reduced mod M, so two 32-bit words that differ by a multiple of M (0 and
2**31 - 1, or -1 and 2**31 - 2 read as int32) count as one; apart from those, since M is prime
and every weight differs, any one changed word, and any two words swapped (rows in another
order), change it, and other differences collide with probability about 2**-31.
A fingerprint, not a cryptographic hash. It costs one
elementwise pass over the batch's words on the batch's device (tokens and labels: 2 x 8 bytes
per position, microseconds next to a step) and no host synchronisation: the agreement's
check reads it back with the step numbers, the one synchronisation it already had.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fxpar.errors import BatchMismatchError
from fxpar.runtime.process_groups import RankGroup

MODULUS = 2**31 - 1  # a Mersenne prime: the fingerprint's field
_MULTIPLIER = 1_103_515_245  # c: the weights' step, below 2**31 so products stay below 2**62
_weights: dict[tuple[int, torch.device], torch.Tensor] = {}  # (words, device) -> weights


@dataclass(frozen=True)
class BatchIdentity:
    """One rank's block (module doc) and how to read it: `block` is int64 on the step's
    device, `ndims` each input's number of dims (how the block's sizes split by input)."""

    block: torch.Tensor
    ndims: tuple[int, ...]

    @classmethod
    def of(cls, chunks: Sequence[Sequence[torch.Tensor]], device: torch.device) -> BatchIdentity:
        """The identity of a step given as `chunks`, its microbatches (each a tuple of the
        inputs' pieces along dim 0), without a host synchronisation. The sizes are the whole
        local batch's."""
        fingerprint = torch.zeros((), dtype=torch.int64, device=device)
        sizes: list[int] = []
        ndims: list[int] = []
        for position, pieces in enumerate(zip(*chunks)):  # per input, its microbatch pieces
            shape = list(pieces[0].shape)
            if shape:
                shape[0] = sum(piece.shape[0] for piece in pieces)
            sizes += shape
            ndims.append(len(shape))
            words = torch.cat([_words(piece).to(device) for piece in pieces])
            input_print = (words * _weights_for(words.numel(), device) % MODULUS).sum() % MODULUS
            # Chained by position, so two inputs swapped differ too.
            fingerprint = (fingerprint * _MULTIPLIER + input_print + position) % MODULUS
        block = torch.cat((fingerprint.reshape(1), torch.tensor(sizes, dtype=torch.int64, device=device)))
        return cls(block, tuple(ndims))

    def check(self, group: RankGroup, blocks: torch.Tensor, names: Sequence[str]) -> None:
        """Raise BatchMismatchError unless every member's block among the summed `blocks`
        (the group's, in member order) equals this rank's; `names` name the inputs."""
        own = self.block.tolist()
        rows = blocks.reshape(group.size, -1).tolist()
        differing = [(rank, row) for rank, row in zip(group.ranks, rows) if row != own]
        if differing:
            raise BatchMismatchError(self._mismatch(group, own, differing, names))

    def _mismatch(self, group: RankGroup, own: list[int], differing: list[tuple[int, list[int]]],
                  names: Sequence[str]) -> str:
        """What a member of `group` says when others' blocks differ from its own, `own`."""
        rank, row = differing[0]
        if own[1:] != row[1:]:
            shapes = []
            start = 1
            for name, ndim in zip(names, self.ndims):
                ours, theirs = tuple(own[start:start + ndim]), tuple(row[start:start + ndim])
                start += ndim
                if ours != theirs:
                    shapes.append(f"{name} of shape {_shape(theirs)} on rank {rank}, {_shape(ours)} on rank {group.rank}")
            what = f"their shapes differ ({'; '.join(shapes)})"
        else:
            what = (f"the shapes agree but the values differ (fingerprints {row[0]:#010x} on rank "
                    f"{rank}, {own[0]:#010x} on rank {group.rank})")
        others = ", ".join(str(r) for r, _ in differing)
        return (
            f"rank {group.rank} and rank{'s' if len(differing) > 1 else ''} {others} of the {group.name} "
            f"were given different batches: {what}. The ranks of a {group.axis.value} group compute "
            "one model split across them and must be given the same batch; the step stops before "
            "any of its data moves. A data loader sharded by the global rank gives them different "
            "rows. Fix: shard the data by the data-parallel rank only (give every rank the global "
            "batch and let runner.local_batch(...) take its slice)"
        )


def _shape(sizes: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, sizes)) + ("," if len(sizes) == 1 else "") + ")"


def _words(piece: torch.Tensor) -> torch.Tensor:
    """`piece`'s bits as int64 words in [0, MODULUS), at most 32 bits each, in memory order."""
    flat = piece.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.element_size() == 8:
        flat = flat.view(torch.int32)
    elif flat.element_size() not in (1, 2, 4):  # complex128 and the like: bytes
        flat = flat.view(torch.uint8)
    words = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[flat.element_size()])
    return words.to(torch.int64) % MODULUS  # negatives into [0, MODULUS): products < 2**62


def _weights_for(count: int, device: torch.device) -> torch.Tensor:
    """w_i = (i + 1) * c mod M for i < `count`, cached per size and device."""
    key = (count, device)
    if key not in _weights:
        if len(_weights) >= 64:  # a run of ever-changing sizes keeps only the latest
            _weights.pop(next(iter(_weights)))
        index = torch.arange(1, count + 1, dtype=torch.int64, device=device) % MODULUS
        _weights[key] = index * _MULTIPLIER % MODULUS
    return _weights[key]
