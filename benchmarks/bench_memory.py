"""Memory per rank, predicted against measured, for every ZeRO stage; and a budget only ZeRO fits.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_memory.py --budget-mib 48

Trains examples/gpt.py's GPT (the harness's "medium": 4 layers, width 256, vocabulary 256,
global batch 16 x 64) for a few AdamW steps under each plan, then prints, per memory term,
what `program.estimate()` predicts for this rank and what `runner.memory_stats()` counts
from its tensors (every storage once; after a step, before `zero_grad`, so gradients and
optimizer state are all held). ZeRO (Rajbhandari et al. 2020, Sec. 5) for fp32 Adam: 16P per
rank without it, 8P + 8P/N under stage 1, 4P + 12P/N under 2, 16P/N under 3.

`--budget-mib B` then asks the question a user asks: which plans keep a rank's memory (model
state and the activations saved for backward at their peak) within B MiB? The replicated plan does not; ZeRO-3 does, and it trains (its losses are
printed, and they equal the replicated plan's to 1e-5 relative, or the script exits 1).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import fxpar
from harness import GPT_SIZES, OPTIMIZER, format_table, global_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

TERMS = ("params", "grads", "optimizer", "activations")
HELD = ("params", "grads", "optimizer", "activations")


def train(plan: str, model_name: str, steps: int):
    torch.manual_seed(0)
    model = GPT(GPT_SIZES[model_name])
    batches = global_batches(GPT_SIZES[model_name].vocab_size, steps, 1)
    program = fxpar.compile(model, plan, example_inputs=batches[0])
    runner = program.bind(timeout=120)
    optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    losses = []
    for i, batch in enumerate(batches):
        losses.append(runner.step(*runner.local_batch(*batch)))
        optimizer.step()
        if i == steps - 1:
            measured = runner.memory_stats()
        optimizer.zero_grad()
    estimate = program.estimate("h100")  # the worst rank's: under dp alone every rank's
    runner.close()
    return losses, measured, estimate.memory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", choices=list(GPT_SIZES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-mib", type=float, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    plans = [f"dp={world}"] + [f"dp={world} zero={z}" for z in (1, 2, 3)]
    rows, results = [], {}
    for plan in plans:
        losses, measured, predicted = train(plan, args.model, args.steps)
        results[plan] = (losses, measured, predicted)
        for term in TERMS:
            if term in measured and measured[term] is not None and term in predicted:
                rows.append([plan, term, f"{predicted[term] / 2**20:.3f}", f"{measured[term] / 2**20:.3f}",
                             f"{measured[term] / predicted[term]:.3f}" if predicted[term] else "-"])
    if int(os.environ["RANK"]) != 0:
        return 0
    print(f"examples/gpt.py GPT '{args.model}', AdamW fp32, {world} ranks, gloo on CPU, torch "
          f"{torch.__version__}; MiB per rank, rank 0, after step {args.steps} before zero_grad")
    print(format_table(["plan", "term", "predicted MiB", "measured MiB", "measured/predicted"], rows))
    status = 0
    if args.budget_mib is not None:
        print(f"\nbudget: {args.budget_mib:g} MiB per rank (params + grads + optimizer + activations)")
        reference = results[plans[0]][0]
        for plan, (losses, measured, predicted) in results.items():
            state = sum(measured.get(t) or 0 for t in HELD) / 2**20
            fits = state <= args.budget_mib
            same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, reference))
            status |= 0 if same else 1
            print(f"  {plan:<14} {state:8.2f} MiB  {'fits' if fits else 'does not fit'}; losses "
                  f"{', '.join(f'{x:.4f}' for x in losses)}{'' if same else '  (DIFFER from dp alone)'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
