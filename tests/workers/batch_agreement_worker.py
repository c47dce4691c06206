"""torchrun worker: the two ranks of a tp group or a pipeline are given different batches.

    torchrun --nproc-per-node 2 batch_agreement_worker.py OUT_DIR PLAN:CASE [PLAN:CASE ...]

For each case both ranks bind the tiny GPT under PLAN (a 5 s timeout on every group), train
one step on the same batch, then step on a batch that differs on rank 1: CASE `rows` gives it
other rows of the same shape (a loader sharded by global rank), `shape` half the rows. Each
rank saves, per case, the steps that succeeded, the error's type and message, and how long
the failed step took (far under the timeout when the agreement, not a hung call, stopped it).
"""

import sys
import time
from pathlib import Path

import torch

import fxpar
from tiny_training import build_model

out_dir, cases = Path(sys.argv[1]), sys.argv[2:]
generator = torch.Generator().manual_seed(0)
tokens, labels = (torch.randint(0, 64, (8, 16), generator=generator) for _ in range(2))
results = {}
for case in cases:
    plan, kind = case.split(":")
    runner = fxpar.compile(build_model(), plan, example_inputs=(tokens, labels)).bind(timeout=5)
    runner.step(tokens, labels)
    outcome = {"steps": 1}
    mine = (tokens.roll(1, 0), labels.roll(1, 0)) if kind == "rows" else (tokens[:4], labels[:4])
    start = time.perf_counter()
    try:
        runner.step(*(mine if runner.rank == 1 else (tokens, labels)))
        outcome["steps"] += 1
    except fxpar.FxparError as error:
        outcome |= {"type": type(error).__name__, "error": str(error)}
    outcome["waited"] = time.perf_counter() - start
    results[case] = outcome
    runner.close()
torch.save(results, out_dir / f"rank{runner.rank}.pt")
