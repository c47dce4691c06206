"""torchrun worker: trains each plan given, with and without activation checkpointing.

    torchrun --standalone --nproc-per-node 2 recompute_worker.py OUT_DIR "dp=2" "tp=2 checkpoint=full"

Each argument is `[MODEL:]PLAN[@sgd]`: MODEL is one of tiny_training.MODELS or `explicit`
(explicit_attention.ExplicitAttentionGPT, dropout on), default gpt; `@sgd` trains with SGD
(momentum 0.9), else AdamW (tiny_training.OPTIMIZER). Every plan's training starts from the
same RNG state, so a model with dropout draws the same masks under every plan of one world.
Per plan it saves the loss of every step, the first step's full gradients, the final full
state, `memory_stats()` after the first step, and the prediction of this rank's memory.
"""

import os
import sys
from pathlib import Path

import torch

import fxpar
from fxpar.pictures.rank_memory import predicted_memory
from explicit_attention import ExplicitAttentionGPT
from tiny_training import OPTIMIZER, fresh_capture, global_batches

out_dir, arguments = Path(sys.argv[1]), sys.argv[2:]
torch.set_num_threads(1)
results = {}
for argument in arguments:
    model_name, _, rest = argument.rpartition(":")
    plan, _, optimizer_name = rest.partition("@")
    tokens, labels = global_batches()[0]
    if model_name == "explicit":
        torch.manual_seed(0)
        model = ExplicitAttentionGPT()
    else:
        model = fresh_capture(model_name or "gpt", (tokens, labels))[1]
    program = fxpar.compile(model, plan, example_inputs=(tokens, labels) if model_name == "explicit" else None)
    program.check()
    runner = program.bind(timeout=60)
    if optimizer_name == "sgd":
        optimizer = runner.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    losses, first_grads, memory = [], None, None
    torch.manual_seed(1)  # dropout's masks: the same draws under every plan
    for tokens, labels in global_batches()[:4]:
        # Copies: a rank's slice of the global batch is a view of all of it, and the meter
        # counts a saved tensor's whole storage (runtime.step.saved_tensors).
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
        # This rank's own prediction: the estimate reports the worst pipeline coordinate's.
        "predicted": predicted_memory(program)[program.mesh.rank_of(pp=program.mesh.coord(runner.rank).pp)],
    }
    runner.close()
torch.save(results, out_dir / f"rank{os.environ['RANK']}.pt")
