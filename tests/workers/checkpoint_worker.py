"""torchrun worker: checkpoints saved under one plan and loaded under another.

    torchrun --standalone --nproc-per-node 2 checkpoint_worker.py OUT_DIR JOB [JOB ...]

Jobs run in order, each binding its own program (closed after):

    save|PLAN|NAME|K[|MODEL]  train the tiny GPT K steps (tiny_training's batches 0..K-1), then
                              runner.save(OUT_DIR/NAME) and runner.save_full(OUT_DIR/NAME.safetensors)
    save|PLAN|NAME|K+M        the same, then train on M more steps (the uninterrupted run)
    load|PLAN|NAME|M[|MODEL]  build the model from another seed (so only the load can make it
                              right), runner.load(OUT_DIR/NAME), train the next M steps
    errors|PLAN|NAME          loading OUT_DIR/NAME into another model, and a missing path: the messages
    faults|PLAN|NAME          train 1 step and save OUT_DIR/NAME; then a save to OUT_DIR/rp_<rank> (another
                              folder on each rank), and one more step saved to NAME while rank 1's disk
                              is full: the messages, what is in OUT_DIR, and NAME loaded after (then
                              saved again, replacing the failed save's NAME.partial)

FXPAR_TEST_GROUPS=1 gives every optimizer `tiny_training.parameter_groups` of its model;
FXPAR_TEST_OPTIMIZERS=muon trains with Muon and AdamW (`tiny_training.muon_and_adamw`), saved
and loaded as a list (save_full writes a file of each one's state).

Each rank saves `rank{r}.pt`: per job, what the test compares (losses, the full state and
optimizer state when saved, right after a load and after the job, what load returned, the
error messages).
"""

import dataclasses
import errno
import os
import sys
from pathlib import Path

import torch

import fxpar
from fxpar.runtime.checkpoint.checksums import ChecksummingFileSystem
from fxpar.runtime.checkpoint.save_load import latest_checkpoint
from tiny_training import (
    CONFIG, GPT, MUON, OPTIMIZER, Optimizers, build_model, fresh_capture, full_optimizer_state, global_batches,
    muon_and_adamw, parameter_groups,
)

out_dir, jobs = Path(sys.argv[1]), sys.argv[2:]
torch.set_num_threads(1)
batches = global_batches()
results = {"folder": out_dir}


def bind(plan: str, model: torch.nn.Module | str, seed: int = 0):
    """`plan` bound for `model`, or for the named model of tiny_training built with `seed`
    (captured once per launch: `fresh_capture`), and its optimizer."""
    if isinstance(model, str):
        name = model
        model, captured = fresh_capture(f"{name} seed {seed}", batches[0], build=lambda: build_model(name, seed=seed))
    else:
        captured = fxpar.capture(model, batches[0])
    program = fxpar.compile(captured, plan)
    program.check()
    runner = program.bind(timeout=60)
    if os.environ.get("FXPAR_TEST_OPTIMIZERS") == "muon":
        matrices, rest = muon_and_adamw(model)
        return runner, Optimizers([runner.optimizer(torch.optim.Muon, param_groups=[{"params": matrices}], **MUON),
                                   runner.optimizer(torch.optim.AdamW, param_groups=[{"params": rest}], **OPTIMIZER)])
    groups = parameter_groups(model) if os.environ.get("FXPAR_TEST_GROUPS") == "1" else None
    return runner, runner.optimizer(torch.optim.AdamW, param_groups=groups, **OPTIMIZER)


def train(runner, optimizer, steps) -> list[float]:
    losses = []
    for tokens, labels in steps:
        losses.append(runner.step(*runner.local_batch(tokens, labels)))
        optimizer.step()
        optimizer.zero_grad()
    return losses


for job in jobs:
    kind, plan, name, *count = job.split("|")
    model_name = count[1] if len(count) > 1 else "gpt"
    path = out_dir / name  # (an absolute NAME: another launch's checkpoint)
    if kind == "save":
        runner, optimizer = bind(plan, model_name)
        k, _, more = count[0].partition("+")
        k = int(k)
        losses = train(runner, optimizer, batches[:k])
        generator_state = torch.get_rng_state()
        runner.save(path, optimizer=optimizer, step=k, extra={"next_batch": k, "plan": plan})
        runner.save_full(out_dir / f"{name}.safetensors", optimizer=optimizer)
        results[job] = {"losses": losses, "latest": latest_checkpoint(out_dir), "rng": generator_state,
                        "saved": runner.full_state_dict(), "saved_optimizer": full_optimizer_state(runner, optimizer)}
        torch.manual_seed(1000 + runner.rank)  # what a load under the same plan must undo
        if more:
            results[job]["losses_after"] = train(runner, optimizer, batches[k : k + int(more)])
            results[job]["state"] = runner.full_state_dict()
    elif kind == "load":
        runner, optimizer = bind(plan, model_name, seed=7)
        resumed = runner.load(path, optimizer=optimizer)
        generator_state = torch.get_rng_state()
        loaded, loaded_optimizer = runner.full_state_dict(), full_optimizer_state(runner, optimizer)
        start = resumed.extra["next_batch"]
        losses = train(runner, optimizer, batches[start : start + int(count[0])])
        results[job] = {"losses": losses, "resumed": resumed, "rng": generator_state, "state": runner.full_state_dict(),
                        "optimizer": full_optimizer_state(runner, optimizer), "loaded": loaded,
                        "loaded_optimizer": loaded_optimizer}
    elif kind == "errors":  # the checkpoint into other models: their messages
        other_models = {
            "llama": build_model("llama"),  # other names
            "wider": GPT(dataclasses.replace(CONFIG, n_embd=48)),  # the same names, other shapes
        }
        messages = {}
        for label, model in other_models.items():
            runner, optimizer = bind(plan, model)
            cases = [(label, path)] + ([("missing", out_dir / "no-such-checkpoint")] if label == "llama" else [])
            for case, target in cases:
                try:
                    runner.load(target, optimizer=optimizer)
                    messages[case] = None
                except fxpar.CheckpointError as error:
                    messages[case] = str(error)
            runner.close()
        results[job] = messages
        continue
    elif kind == "faults":
        runner, optimizer = bind(plan, "gpt")
        train(runner, optimizer, batches[:1])
        runner.save(path, optimizer=optimizer, step=1)
        saved = runner.full_state_dict()
        messages = {}
        try:
            runner.save(out_dir / f"rp_{runner.rank}", optimizer=optimizer, step=1)
        except fxpar.CheckpointError as error:
            messages["folders"] = str(error)
        train(runner, optimizer, batches[1:2])
        writable = ChecksummingFileSystem.open_for_writing
        if runner.rank == 1:
            def full(self, file, mode):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
            ChecksummingFileSystem.open_for_writing = full
        try:
            runner.save(path, optimizer=optimizer, step=2)
        except fxpar.CheckpointError as error:
            messages["disk full"] = str(error)
        ChecksummingFileSystem.open_for_writing = writable
        resumed = runner.load(path, optimizer=optimizer)
        results[job] = {"messages": messages, "step": resumed.step, "listing": sorted(p.name for p in out_dir.iterdir()),
                        "intact": all(torch.equal(runner.full_state_dict()[k], v) for k, v in saved.items())}
        runner.save(path, optimizer=optimizer, step=1)  # the failed save's lock released: this one commits
    else:
        raise SystemExit(f"unknown job {job!r}")
    runner.close()

torch.save(results, out_dir / f"rank{os.environ['RANK']}.pt")
