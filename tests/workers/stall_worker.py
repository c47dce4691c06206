"""torchrun worker: rank 1 stops issuing collectives; rank 0 must fail within the timeout.

    torchrun --nproc-per-node 2 stall_worker.py OUT_DIR [PLAN]      (PLAN: "dp=2" by default)

Rank 0 saves the error it got and how long it waited; rank 1 sleeps past the timeout, then
exits quietly so that torchrun itself does not tear rank 0 down first.
"""

import os
import sys
import time
from pathlib import Path

import torch

import fxpar
from tiny_training import build_model, global_batches

TIMEOUT_S = 3
out_dir = Path(sys.argv[1])
plan = sys.argv[2] if len(sys.argv) > 2 else "dp=2"
tokens, labels = global_batches()[0]
runner = fxpar.compile(build_model(), plan, example_inputs=(tokens, labels)).bind(timeout=TIMEOUT_S)
if runner.rank == 1:
    time.sleep(TIMEOUT_S + 6)
    torch.save({}, out_dir / "rank1.pt")
    os._exit(0)
start = time.perf_counter()
try:
    runner.step(*runner.local_batch(tokens, labels))
    outcome = {"error": None}
except fxpar.CollectiveError as error:
    outcome = {"error": str(error), "type": type(error).__name__}
outcome["waited"] = time.perf_counter() - start
torch.save(outcome, out_dir / "rank0.pt")
os._exit(0)  # the group is broken: destroying it would wait on the silent peer
