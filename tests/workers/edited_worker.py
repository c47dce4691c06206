"""torchrun worker: rank 1's step program is edited (bucket 0 resized); check and run see it.

    torchrun --nproc-per-node 2 edited_worker.py OUT_DIR

Every rank compiles the same program and edits rank 1's step program the same way. `check()`
must refuse it; then the run goes ahead anyway: rank 1's guard must stop it before it
all-reduces bucket 0, and rank 0, whose program is the original, must fail within the timeout
instead of pairing its bucket with anything else. Each rank saves what it saw.
"""

import os
import sys
import time
from pathlib import Path

import torch

import fxpar
from fxpar.ir.step_program import Communicate, Purpose
from step_program_edits import resize_call
from tiny_training import build_model, global_batches

TIMEOUT_S = 3
out_dir = Path(sys.argv[1])
tokens, labels = global_batches()[0]
program = fxpar.compile(build_model(), "dp=2 bucket_mb=0.02", example_inputs=(tokens, labels))
step = program.step_program(1, backend="gloo")
bucket = next(i for i, a in enumerate(step.actions)
              if isinstance(a, Communicate) and a.purpose is Purpose.GRADIENT_BUCKET)
program.replace_step_program(1, resize_call(step, sum(len(a.calls) for a in step.actions[:bucket]), 7))
outcome = {}
try:
    program.check()
except fxpar.PlanError as error:
    outcome["check"] = str(error)
runner = program.bind(timeout=TIMEOUT_S)
start = time.perf_counter()
try:
    runner.step(*runner.local_batch(tokens, labels))
except fxpar.CollectiveError as error:  # StepProgramError is one
    outcome |= {"error": str(error), "type": type(error).__name__}
outcome["waited"] = time.perf_counter() - start
if runner.rank == 1:
    time.sleep(TIMEOUT_S + 3)  # rank 0 fails on its own timeout, not torchrun's teardown
torch.save(outcome, out_dir / f"rank{runner.rank}.pt")
os._exit(0)  # the group is broken: destroying it would wait on the failed peer
