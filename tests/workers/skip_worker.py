"""torchrun worker: rank 1's step fails on a bad batch, it catches the error and carries on.

    torchrun --nproc-per-node 2 skip_worker.py OUT_DIR PLAN [PLAN ...]

For each plan (two ranks on one axis: dp, tp or pp) both ranks bind, take one good step, then
rank 1 is handed a batch without its labels: its second `runner.step` raises before any
collective, it catches that and goes on to its third, while rank 0 is in its second. The
step agreement (`runtime.step.agreement`) must stop both, naming both step numbers, at the
first collective of the step. Each rank saves, per plan, what it caught and how long its
failing step took; then closes the runner and binds the next plan's (the groups are intact:
the agreement's all-reduce completed).
"""

import sys
import time
from pathlib import Path

import torch

import fxpar
from tiny_training import fresh_capture, global_batches

TIMEOUT_S = 5
out_dir, plans = Path(sys.argv[1]), sys.argv[2:]
batches = global_batches()
results = {}
for plan in plans:
    runner = fxpar.compile(fresh_capture("gpt", batches[0])[1], plan).bind(timeout=TIMEOUT_S)
    outcome = {"steps": 0}
    for i, (tokens, labels) in enumerate(batches[:3]):
        start = time.perf_counter()
        try:
            batch = runner.local_batch(tokens, labels)
            if runner.rank == 1 and i == 1:
                batch = batch[:1]  # the labels are missing: step() raises before communicating
            runner.step(*batch)
            outcome["steps"] += 1
        except fxpar.StepMismatchError as error:
            outcome |= {"error": str(error), "type": type(error).__name__,
                        "waited": time.perf_counter() - start}
            break
        except Exception as error:  # noqa: BLE001  the bad batch: carry on, as the scenario says
            outcome["caught"] = f"{type(error).__name__}: {error}"
    results[plan] = outcome
    runner.close()
torch.save(results, out_dir / f"rank{runner.rank}.pt")
