"""torchrun worker: gradient accumulation across `runner.step` calls, under each plan given.

    torchrun --standalone --nproc-per-node 2 accumulation_worker.py OUT_DIR "dp=2" "dp=2 zero=2"

Each plan runs `SCRIPT` (also what `one_device` runs, on one device): batches 0 and 1 of
`tiny_training.global_batches`, with and without `zero_grad` between steps, reading the whole
gradients after every step and the parameters after one optimizer step. The parameters do not
change before that step, so every gradient read is at the initial weights.
"""

import sys
from pathlib import Path

import torch

import fxpar
from tiny_training import build_model, fresh_capture, global_batches

# (batch, what comes before its step). SGD, not AdamW: AdamW's first update is lr x sign(g)
# whatever the size of g, so it would not tell an accumulated gradient from a scaled one.
SCRIPT = [(0, None), (1, None), (1, "zero_grad(set_to_none=False)"), (0, "zero_grad()"), (1, None)]
SGD = dict(lr=0.1)


def run(step, full_gradients, optimizer) -> dict:
    """`SCRIPT` through `step(batch) -> loss` and `full_gradients() -> {name: grad}`, then
    one step of `optimizer`: each step's loss and the gradients held after it."""
    batches = global_batches()
    losses, grads = [], []
    for batch, before in SCRIPT:
        if before is not None:
            optimizer.zero_grad(set_to_none=before == "zero_grad()")
        losses.append(step(*batches[batch]))
        grads.append(full_gradients())
    optimizer.step()
    return {"losses": losses, "grads": grads}


def one_device() -> dict:
    """`run` on one device, fp32: each backward adds into `.grad`."""
    model = build_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    def step(tokens, labels) -> float:
        loss = model(tokens, labels)
        loss.backward()
        return loss.item()

    def full_gradients() -> dict:
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    result = run(step, full_gradients, torch.optim.SGD(model.parameters(), **SGD))
    return result | {"initial": initial, "state": model.state_dict()}


def main(out_dir: Path, plans: list[str]) -> None:
    torch.set_num_threads(1)
    results = {}
    tokens, labels = global_batches()[0]
    for plan in plans:
        _, captured = fresh_capture("gpt", (tokens, labels))
        program = fxpar.compile(captured, plan)
        runner = program.bind(timeout=60)
        optimizer = runner.optimizer(torch.optim.SGD, **SGD)
        step = lambda *batch: runner.step(*runner.local_batch(*batch))  # noqa: E731
        results[plan] = run(step, runner.full_gradients, optimizer) | {"state": runner.full_state_dict()}
        rank = runner.rank
        runner.close()  # the next plan trains the same (captured) model's parameters
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
