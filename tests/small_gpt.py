"""One small GPT, captured once per test session, for the tests of what reads a program.

    from small_gpt import small_capture
    program = fxpar.compile(small_capture(), "dp=2 tp=2 pp=2 mb=2")

`examples/gpt.py:factory` at 2 layers, 4 heads, width 32, a vocabulary of 64 and a global
batch of 8 x 16 tokens: big enough for every parallelism of the plans these tests draw
(tp=2 splits the heads, pp=2 puts a block on each stage, dp x mb = 4 splits the batch), small
enough that a compile takes a fraction of a second. Compiling copies the captured graph, so
a test may change a compiled program's node meta without touching the shared capture.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import fxpar

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import factory  # noqa: E402


@functools.cache
def small_capture() -> fxpar.CapturedGraph:
    model, inputs = factory(n_layer=2, n_head=4, n_embd=32, vocab_size=64, seq=16, batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxpar.capture(model, inputs)
