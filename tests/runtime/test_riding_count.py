"""The count of valid targets as float digits (`runtime.step.riding_count`): summed over ranks in a
float32 bucket, the digits give back the exact sum of the counts, beyond float32's 2**24."""

import torch

from fxpar.compiler.lowering import COUNT_RIDES_UP_TO, COUNT_SLOTS
from fxpar.runtime.step import riding_count


def test_digits_summed_in_float32_over_the_most_ranks_give_the_exact_total():
    counts = [2**24 + 1, 4095, 0, 2**30 + 12_345]  # float32 alone would round the first and last
    summed = sum(riding_count.digits(torch.tensor(c), COUNT_SLOTS, torch.float32) for c in counts)
    assert int(riding_count.number(summed, 0, COUNT_SLOTS)) == sum(counts)
    # The worst low digit on every one of the most ranks still sums exactly in float32.
    worst = riding_count.digits(torch.tensor(4095), COUNT_SLOTS, torch.float32) * COUNT_RIDES_UP_TO
    assert int(riding_count.number(worst, 0, COUNT_SLOTS)) == 4095 * COUNT_RIDES_UP_TO


def test_the_digits_sit_anywhere_in_a_bucket():
    bucket = torch.zeros(10)
    bucket[6:8] = riding_count.digits(torch.tensor(123_456_789), 2, bucket.dtype)
    assert int(riding_count.number(bucket, 6, 8)) == 123_456_789
