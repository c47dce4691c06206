"""ZeRO-2 and ZeRO-3 reducing per microbatch against per step, measured and as the cost model priced it.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_zero_reduce.py --steps 20 --warmup 3

With gradient accumulation a ZeRO-2/3 step may reduce-scatter each microbatch's gradients or
the step's sum once (`fxpar.plan.zero_reduction`); `zero_reduce=auto` takes the mode the estimate
prices faster on compile's hardware profile, per microbatch on a tie. This runs both modes of
one plan side by side (`harness.run_interleaved`, two copies of one model, same batches and
AdamW) and prints the measured step-time ratio next to the estimate's (on the measured "cpu"
profile) and the mode auto chose, so the cost model's choice is checked against the clock.
The two modes' losses must agree to 1e-5 relative (only the summation order differs), or the
script exits 1.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch

import fxpar
from harness import (
    GPT_SIZES, OPTIMIZER, Side, first_mismatch, format_table, global_batches, paired_ratio,
    run_interleaved, runner_step, side_by_side_arguments, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

LOSS_RELATIVE = 1e-5
MODES = ("microbatch", "step")


def parse_args():
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", choices=list(GPT_SIZES))
    parser.add_argument("--microbatches", type=int, default=4)
    return parser.parse_args()


def bench_stage(zero: int, args) -> dict:
    config = GPT_SIZES[args.model]
    torch.manual_seed(0)
    model = GPT(config)
    world = int(os.environ["WORLD_SIZE"])
    batches = global_batches(config.vocab_size, args.warmup + args.steps, 1)
    plan = f"dp={world} zero={zero} mb={args.microbatches}"
    sides, predicted, runners = [], {}, []
    for mode in MODES:
        program = fxpar.compile(copy.deepcopy(model), f"{plan} zero_reduce={mode}", example_inputs=batches[0])
        predicted[mode] = program.estimate("cpu").time["total"]
        runner = program.bind(timeout=120)
        optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
        sides.append(Side(mode, runner_step(runner, optimizer, [runner.local_batch(*b) for b in batches])))
        runners.append(runner)
    auto = fxpar.compile(copy.deepcopy(model), plan, example_inputs=batches[0], check=False).zero_reduce
    runs = run_interleaved(sides, warmup=args.warmup, steps=args.steps, block=args.block)
    mismatch = first_mismatch(runs["microbatch"].losses, runs["step"].losses, rel=LOSS_RELATIVE)
    each, once = runs["microbatch"].timing, runs["step"].timing
    for runner in runners:
        runner.close()
    return {
        "zero": zero, "plan": plan, "auto": auto.mode,
        "microbatch_ms": each.median * 1e3, "step_ms": once.median * 1e3,
        "ratio": each.median / once.median, "paired_ratio": paired_ratio(once, each),
        "predicted_ratio": predicted["microbatch"] / predicted["step"], "losses_match": mismatch is None,
    }


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    results = [bench_stage(zero, args) for zero in (2, 3)]
    if int(os.environ["RANK"]) == 0:
        print(f"\n{args.model} GPT, gloo on CPU, torch {torch.__version__}, median of {args.steps} steps after "
              f"{args.warmup} warm-up, load average {os.getloadavg()[1]:.1f} (5 min)")
        header = ["plan", "per microbatch ms", "per step ms", "measured ratio", "paired", "predicted ratio",
                  "auto chose", "losses match"]
        rows = [[r["plan"], f"{r['microbatch_ms']:.1f}", f"{r['step_ms']:.1f}", f"{r['ratio']:.3f}",
                 f"{r['paired_ratio']:.3f}", f"{r['predicted_ratio']:.3f}", r["auto"],
                 "yes" if r["losses_match"] else "NO"] for r in results]
        print(format_table(header, rows))
        if args.json is not None:
            write_json(args.json, args, results)
    return 0 if all(r["losses_match"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
