"""torchrun worker: every rank is handed labels outside the vocabulary, then a good batch.

    torchrun --nproc-per-node 2 batch_worker.py OUT_DIR PLAN [PLAN ...]

For each plan both ranks bind the tiny GPT (vocabulary 64) and call `runner.step` on a
global batch whose labels hold 64 in row 1 and -1 in row 5 (one in each dp half): each rank
must raise BatchError for what it holds before the step communicates, then train on the next
batch (both counted the failed call, so the step agreement holds). Each rank saves, per plan,
the message, what the failed step issued, how long it took, and the next step's loss.
"""

import sys
import time
from pathlib import Path

import torch

import fxpar
from tiny_training import fresh_capture, global_batches

out_dir, plans = Path(sys.argv[1]), sys.argv[2:]
batches = global_batches()
results = {}
for plan in plans:
    runner = fxpar.compile(fresh_capture("gpt", batches[0])[1], plan).bind(timeout=20)
    tokens, labels = batches[0]
    labels = labels.clone()
    labels[1, 3], labels[5, 2] = 64, -1
    outcome = {}
    runner.reset_comm_stats()
    start = time.perf_counter()
    try:
        runner.step(*runner.local_batch(tokens, labels))
    except fxpar.BatchError as error:
        outcome |= {"error": str(error), "waited": time.perf_counter() - start, "issued": runner.comm_stats()}
    outcome["loss"] = runner.step(*runner.local_batch(*batches[1]))
    results[plan] = outcome
    runner.close()
torch.save(results, out_dir / f"rank{runner.rank}.pt")
