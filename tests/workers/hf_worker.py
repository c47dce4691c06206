"""torchrun worker: trains Hugging Face models (tests/hf_models.py), as they are, under plans.

    torchrun --standalone --nproc-per-node 2 hf_worker.py OUT_DIR "llama sdpa dp=2 mb=2" ...

Each job is "MODEL ATTENTION PLAN" (a model of hf_models.BUILDERS or SURVEY). The model is passed to fxpar unwrapped, with keyword
inputs ({"input_ids": ..., "labels": ...}), captured once per model and attention, and put back
as built for each job (`tiny_training.fresh_capture`; each runner is closed before the next
binds). The memory prediction is computed by rank 0 and sent to the others (every rank would
compute the same numbers, several at once on CI's two cores). Saved per job: the loss of every step, the whole
gradients of the first step, the full state after the last, the last step's collectives
with what the compiler predicted, and `memory_stats()` after the first optimizer step with this
rank's prediction of it. With FXPAR_TEST_NORM set, also the first step's global gradient
2-norm, from `runner.clip_grad_norm_(inf)` (which scales nothing).
"""

import os
import sys
from pathlib import Path

import torch

import fxpar
from fxpar.pictures.rank_memory import predicted_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_models import OPTIMIZER, batches, builder  # noqa: E402
from tiny_training import computed_on_rank_0, fresh_capture  # noqa: E402

out_dir, jobs = Path(sys.argv[1]), sys.argv[2:]
torch.set_num_threads(1)
results, built = {}, {}
for job in jobs:
    name, attention, plan = job.split(" ", 2)
    if (name, attention) not in built:
        built[name, attention] = builder(name)(attention)
    model, example = built[name, attention]
    model, captured = fresh_capture(f"{name} {attention}", example, build=lambda: model)
    program = fxpar.compile(captured, plan)
    program.check()
    runner = program.bind(timeout=60)
    optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    losses, first_grads, memory = [], None, None
    for batch in batches(name):
        runner.reset_comm_stats()
        local = runner.local_batch(batch)
        losses.append(runner.step(local))
        optimizer.step()
        if first_grads is None:  # the step's gradients, still there until zero_grad
            norm = runner.clip_grad_norm_(float("inf")).item() if os.environ.get("FXPAR_TEST_NORM") else None
            first_grads = runner.full_gradients()
            memory = runner.memory_stats()
        optimizer.zero_grad()
    results[job] = {
        "losses": losses,
        "grads": first_grads,
        "norm": norm,
        "state": runner.full_state_dict(),
        "comm": runner.comm_log(),
        "predicted": program.collectives(runner.rank, backend=runner.backend),
        "memory": memory,
        "microbatch_rows": len(local["input_ids"]) // program.plan.microbatches,
        # this rank's own: the estimate reports the worst pipeline coordinate's
        "predicted_memory": computed_on_rank_0(lambda: predicted_memory(program))[
            program.mesh.rank_of(pp=program.mesh.coord(runner.rank).pp)],
    }
    runner.close()  # before the next job binds the same parameters
torch.save(results, out_dir / f"rank{runner.rank}.pt")
