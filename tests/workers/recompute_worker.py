"""torchrun worker: trains each plan given, with and without activation checkpointing.

    torchrun --standalone --nproc-per-node 2 recompute_worker.py OUT_DIR "dp=2" "tp=2 checkpoint=full"

An argument `PLAN@sgd` trains with SGD (momentum 0.9), else AdamW (tiny_training.OPTIMIZER).
Per plan it saves the loss of every step, the first step's full gradients, the final full
state, `memory_stats()` after the first step, and the estimate's activation bytes.
FXPAR_TEST_MODEL picks the model of tiny_training.MODELS (default gpt).
"""

import os
import sys
from pathlib import Path

import torch

import fxpar
from tiny_training import OPTIMIZER, build_model, global_batches

out_dir, arguments = Path(sys.argv[1]), sys.argv[2:]
torch.set_num_threads(1)
model_name = os.environ.get("FXPAR_TEST_MODEL", "gpt")
results = {}
for argument in arguments:
    plan, _, optimizer_name = argument.partition("@")
    tokens, labels = global_batches()[0]
    program = fxpar.compile(build_model(model_name), plan, example_inputs=(tokens, labels))
    program.check()
    runner = program.bind(timeout=60)
    if optimizer_name == "sgd":
        optimizer = runner.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    losses, first_grads, memory = [], None, None
    for tokens, labels in global_batches()[:4]:
        # Copies: a rank's slice of the global batch is a view of all of it, and the meter
        # counts a saved tensor's whole storage (runtime.saved_tensors).
        local = [t.to(runner.device).clone() for t in runner.local_batch(tokens, labels)]
        losses.append(runner.step(*local))
        if first_grads is None:
            first_grads = runner.full_gradients()
            memory = runner.memory_stats()
        optimizer.step()
        optimizer.zero_grad()
    estimate = program.estimate("h100", optimizer="sgd" if optimizer_name == "sgd" else "adamw")
    results[argument] = {
        "rank": runner.rank,
        "losses": losses,
        "grads": first_grads,
        "state": runner.full_state_dict(),
        "memory": memory,
        "estimate": {"rank": estimate.rank, **estimate.memory, "flops": estimate.flops,
                     "time": estimate.time},
    }
    runner.close()
torch.save(results, out_dir / f"rank{os.environ['RANK']}.pt")
