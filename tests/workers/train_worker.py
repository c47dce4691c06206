"""torchrun worker: trains the tiny GPT under each plan given, saves what the test compares.

    torchrun --standalone --nproc-per-node 2 train_worker.py OUT_DIR "dp=2" "dp=2 mb=2 bucket_mb=0.01"

FXPAR_TEST_MODEL picks the model of tiny_training.MODELS (default gpt). FXPAR_TEST_DEVICE
and FXPAR_TEST_BACKEND, when set, choose bind()'s device and backend (the GPU tier runs NCCL on
one GPU, or several gloo ranks sharing one GPU). FXPAR_TEST_RECEIVES_AHEAD sets
`Runner.receives_ahead` (0 runs a pipeline in NCCL's transfer order on gloo).
FXPAR_TEST_SCHEDULED=1 steps `tiny_training.lr_scheduler` after each optimizer step;
FXPAR_TEST_CLIP=x clips the gradients to global norm x before it (`runner.clip_grad_norm_`).
FXPAR_TEST_GROUPS=1 gives the optimizer `tiny_training.parameter_groups` of the compiled model,
=names the same groups by parameter name; FXPAR_TEST_OPTIMIZERS=muon trains with Muon and AdamW
over `tiny_training.muon_and_adamw`'s parameters.
"""

import math
import os
import sys
from pathlib import Path

import torch

import fxpar
from tiny_training import (
    MUON, OPTIMIZER, Optimizers, computed_on_rank_0, fresh_capture, full_optimizer_state, global_batches,
    lr_scheduler, muon_and_adamw, parameter_groups,
)

out_dir, plans = Path(sys.argv[1]), sys.argv[2:]
torch.set_num_threads(1)


def estimate_terms(program) -> dict:
    """What the tests read of `program.estimate("h100")`: comm, the worst rank, memory."""
    estimate = program.estimate("h100")
    return {"estimated_comm": estimate.comm, "estimated_rank": estimate.rank, "estimated_memory": estimate.memory}


results = {}
for plan in plans:
    tokens, labels = global_batches()[0]
    # Every plan compiled from one capture, its weights put back as built (`fresh_capture`).
    compiled, captured = fresh_capture(os.environ.get("FXPAR_TEST_MODEL", "gpt"), (tokens, labels))
    program = fxpar.compile(captured, plan)
    program.check()
    runner = program.bind(
        timeout=60,
        device=os.environ.get("FXPAR_TEST_DEVICE"),
        backend=os.environ.get("FXPAR_TEST_BACKEND"),
    )
    if "FXPAR_TEST_RECEIVES_AHEAD" in os.environ:  # e.g. NCCL's pipeline order, run on gloo
        runner.receives_ahead = int(os.environ["FXPAR_TEST_RECEIVES_AHEAD"])
    groups = parameter_groups(compiled) if os.environ.get("FXPAR_TEST_GROUPS") else None
    if os.environ.get("FXPAR_TEST_GROUPS") == "names":
        name_of = {id(p): n for n, p in compiled.named_parameters()}
        groups = [g | {"params": [name_of[id(p)] for p in g["params"]]} for g in groups]
    optimizer = runner.optimizer(torch.optim.AdamW, param_groups=groups, **OPTIMIZER)
    if os.environ.get("FXPAR_TEST_OPTIMIZERS") == "muon":
        matrices, rest = muon_and_adamw(compiled)
        optimizer = Optimizers([runner.optimizer(torch.optim.Muon, param_groups=[{"params": matrices}], **MUON),
                                runner.optimizer(torch.optim.AdamW, param_groups=[{"params": rest}], **OPTIMIZER)])
    scheduler = lr_scheduler(optimizer) if os.environ.get("FXPAR_TEST_SCHEDULED") == "1" else None
    # One step at another batch and sequence length than the example: sizes are symbolic.
    small = [t[: program.plan.dp * program.plan.microbatches, :8] for t in (tokens, labels)]
    resized_loss = runner.step(*[t.to(runner.device) for t in runner.local_batch(*small)])
    optimizer.zero_grad()
    clip = float(os.environ["FXPAR_TEST_CLIP"]) if "FXPAR_TEST_CLIP" in os.environ else None
    losses, first_grads, step_logs, memory, norms = [], None, [], None, []
    runner.record_timeline = True  # what the pipeline executor ran (the last step's is kept)
    for tokens, labels in global_batches():
        runner.reset_comm_stats()
        local = [t.to(runner.device) for t in runner.local_batch(tokens, labels)]
        losses.append(runner.step(*local))
        if clip is not None:  # the inf-norm first: a bound of inf leaves the gradients as they are
            norms.append((float(runner.clip_grad_norm_(math.inf, math.inf)), float(runner.clip_grad_norm_(clip))))
        optimizer.step()  # (ZeRO gathers the updated parameters: part of the step's calls)
        step_logs.append((runner.comm_log(), runner.comm_stats()))
        if first_grads is None:  # the step's gradients, still there until zero_grad
            first_grads = runner.full_gradients()
            memory = runner.memory_stats()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    results[plan] = {
        "losses": losses,
        "norms": norms,
        "resized": (resized_loss, [t.clone() for t in small]),
        "grads": first_grads,
        "state": runner.full_state_dict(),
        "optimizer": full_optimizer_state(runner, optimizer),
        "comm": step_logs,
        "predicted": program.collectives(runner.rank, backend=runner.backend,
                                         receives_ahead=runner.receives_ahead),
        **computed_on_rank_0(lambda: estimate_terms(program)),
        "memory": memory,
        "rank": runner.rank,
        "executed": [action for action, _, _ in runner.timeline()],
        "schedule_row": [] if program.stages is None else
        [str(a) for a in program.schedule.actions[program.mesh.coord(runner.rank).pp]],
        "buckets": program.buckets if program.stages is None else [s.buckets for s in program.stages],
        # What the rank computes and steps in (bf16-mixed: bf16 working parameters, fp32 masters).
        "stepped_tensors": sum(len(g["params"]) for g in optimizer.param_groups),
        "dtypes": {
            "parameters": sorted({str(p.dtype) for m in runner.modules for p in m.parameters()}),
            "stepped": sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]}),
            "loss": [str(runner.modules[-1].graph.output_node().args[0].meta["val"].dtype)]
            if program.holds_loss(runner.rank) else [],  # (the loss is the last stage's output)
        },
    }
    runner.close()  # before the next plan binds the same parameters
torch.save(results, out_dir / f"rank{runner.rank}.pt")
