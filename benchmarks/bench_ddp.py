"""fxpar dp=N against torch DistributedDataParallel: same model, weights, data, optimizer, buckets.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ddp.py --steps 30 --warmup 5

For each GPT size, both sides start from the same initial weights (one seeded model, deep-
copied), train on the same global batches with AdamW (PyTorch's default implementation for
the device) and all-reduce gradients in buckets of the same size (`bucket_mb` in the fxpar
plan, `bucket_cap_mb` for DDP). One timed step is everything a training loop does:

    DDP:    loss = ddp(x, y); loss.backward(); opt.step(); opt.zero_grad()
    fxpar:  loss = runner.step(x, y);          opt.step(); opt.zero_grad()

fxpar's step also returns the global-batch mean loss as a float (DDP's loss is this rank's
own); that is part of fxpar's cost and stays in the timed region. The two sides are timed in
alternating blocks (`harness.run_interleaved`), and their global-batch losses must agree to
1e-5 relative at every step, or the comparison is void and the script exits 1.

About DDP's first bucket: with the default `bucket_cap_mb=None`, DDP caps its first bucket
at `torch.distributed._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB) and the others at 25 MiB. Passing
`bucket_cap_mb` explicitly, as here, makes every DDP bucket (the first included) that size
(torch >= 2.13, `_BucketCapacityConfig.create`); older releases kept the 1 MiB first bucket.
The script prints the bucket sizes DDP actually used, after its first-iteration rebuild.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

import fxpar
from harness import (
    GLOBAL_BATCH, GPT_SIZES, OPTIMIZER, SEQ, Side, comparison, first_mismatch, format_table,
    global_batches, mean_over_ranks, mismatch_message, module_step, run_interleaved, run_models,
    runner_step, side_by_side_arguments, timing_cell, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

if TYPE_CHECKING:
    from fxpar.runtime.runner import Runner

MODELS = GPT_SIZES
LOSS_RELATIVE = 1e-5


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket MiB")
    parser.add_argument("--models", nargs="+", default=["tiny", "small", "medium"],
                        choices=list(MODELS))
    parser.add_argument("--ddp-bucket-view", action="store_true",
                        help="DDP with gradient_as_bucket_view=True (its default is False)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def ddp_bucket_bytes(ddp: DistributedDataParallel) -> list[int]:
    """The bucket sizes DDP uses after its rebuild, in launch order."""
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).split(",") if s.strip()]


def bench_model(name: str, args: argparse.Namespace) -> tuple[dict, Runner]:
    """Train one model size under both sides; the result row and this model's runner (left
    open: `harness.run_models` closes the last)."""
    config = MODELS[name]
    torch.manual_seed(args.seed)
    model = GPT(config)
    ddp_model = copy.deepcopy(model)  # same weights, same tying, separate tensors
    batches = global_batches(config.vocab_size, args.warmup + args.steps, args.seed + 1)

    plan = f"dp={int(os.environ['WORLD_SIZE'])} bucket_mb={args.bucket_mb:g}"
    program = fxpar.compile(model, plan, example_inputs=batches[0])
    runner = program.bind(timeout=120)
    fx_optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    local = [runner.local_batch(*b) for b in batches]  # the same slices feed both sides

    ddp = DistributedDataParallel(
        ddp_model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.ddp_bucket_view
    )
    ddp_optimizer = torch.optim.AdamW(ddp.parameters(), **OPTIMIZER)

    ddp_step = module_step(ddp, ddp_optimizer, local)
    fxpar_step = runner_step(runner, fx_optimizer, local)

    runner.reset_comm_stats()
    runs = run_interleaved(
        [Side("ddp", ddp_step), Side("fxpar", fxpar_step)],
        warmup=args.warmup, steps=args.steps, block=args.block,
    )
    ddp_losses = mean_over_ranks(runs["ddp"].losses)
    fx_losses = runs["fxpar"].losses
    mismatch = first_mismatch(ddp_losses, fx_losses, rel=LOSS_RELATIVE)
    steps_run = args.warmup + args.steps
    fx_calls = runner.comm_stats().get("all_reduce", {"count": 0, "bytes": 0})
    result = {
        "model": name,
        "config": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")},
        "parameters": program.captured.parameter_count(),
        "fxpar_buckets": len(program.buckets),
        "fxpar_bucket_bytes": [b.nbytes for b in program.buckets],
        "fxpar_all_reduces_per_step": fx_calls["count"] / steps_run,
        "ddp_bucket_bytes": ddp_bucket_bytes(ddp),
        **comparison(runs, "ddp", ddp_losses, fx_losses, mismatch),
    }
    if mismatch is not None and runner.is_main:
        print(mismatch_message(name, mismatch, ("ddp", "fxpar"), rel=LOSS_RELATIVE), flush=True)
    return result, runner


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # 2 ranks on 2 cores: one compute thread each
    return run_models(args.models, bench_model, args, native="ddp", report=report)


def report(results: list[dict], args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    header = ["model", "params", "buckets fxpar/ddp", "DDP ms/step [p10-p90]",
              "fxpar ms/step [p10-p90]", "fxpar/DDP", "paired", "CPU ms DDP/fxpar", "CPU ratio",
              "losses match"]
    rows = []
    for r in results:
        ddp, fx = r["ddp"], r["fxpar"]
        rows.append([
            r["model"], f"{r['parameters']:,}",
            f"{r['fxpar_buckets']}/{len(r['ddp_bucket_bytes']) or '?'}",
            timing_cell(ddp),
            timing_cell(fx),
            f"{r['ratio']:.3f}",
            f"{r['paired_ratio']:.3f}",
            f"{r['ddp_cpu']['median_ms']:.1f}/{r['fxpar_cpu']['median_ms']:.1f}",
            f"{r['cpu_ratio']:.3f}",
            "yes" if r["losses_match"] else "NO",
        ])
    print()
    print(f"fxpar dp={world} vs DDP, gloo on CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread/rank, global batch {GLOBAL_BATCH}x{SEQ}, "
          f"bucket {args.bucket_mb:g} MiB, median of {args.steps} steps after {args.warmup} "
          f"warm-up (max over ranks), DDP gradient_as_bucket_view={args.ddp_bucket_view}, "
          f"load average {os.getloadavg()[1]:.1f} (5 min)")
    print(format_table(header, rows))
    print("  fxpar/DDP: ratio of the medians; paired: median over k of fxpar step k / DDP step k "
          "(adjacent blocks, so machine noise mostly cancels); CPU: median main-thread CPU "
          "time per step (time.thread_time, mean over ranks), which leaves out waiting")
    def mib(sizes: list[int]) -> str:
        return ", ".join(f"{s / 2**20:.2f}" for s in sizes)

    for r in results:
        print(f"  {r['model']}: fxpar buckets MiB [{mib(r['fxpar_bucket_bytes'])}], "
              f"DDP buckets MiB [{mib(r['ddp_bucket_bytes'])}], max loss rel diff "
              f"{r['max_loss_relative_difference']:.1e}")
    print("  DDP's first bucket: 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES) only "
          "when bucket_cap_mb is left at its default; here it is passed, so every DDP bucket "
          f"is capped at {args.bucket_mb:g} MiB, as fxpar's are.")
    if args.json is not None:
        write_json(args.json, args, results, world_size=world)


if __name__ == "__main__":
    sys.exit(main())
