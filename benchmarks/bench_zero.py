"""fxpar ZeRO-1 and ZeRO-2 against DDP with torch's ZeroRedundancyOptimizer: time and memory.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_zero.py --steps 30 --warmup 5

torch's own ZeRO-1 for data parallelism is `torch.distributed.optim.ZeroRedundancyOptimizer`
wrapped around the optimizer of a DDP model: DDP all-reduces whole gradients, each rank steps
the parameters it owns (whole tensors, assigned to ranks greedily by size), then broadcasts
them (`parameters_as_bucket_view=True`: one flat buffer per rank and dtype, its fastest mode).
fxpar `dp=N zero=1` reduce-scatters each gradient bucket, steps its shard of the flat buckets
and all-gathers them back; `zero=2` also keeps only the reduced gradient shard. One timed step:

    torch:  loss = ddp(x, y); loss.backward(); zero_opt.step(); zero_opt.zero_grad()
    fxpar:  loss = runner.step(x, y);          opt.step();      opt.zero_grad()

Same weights, batches, AdamW(lr=1e-3, weight_decay=0.1) and 1 MiB buckets on both sides,
timed in alternating blocks (`harness.run_interleaved`); the global-batch losses must agree
to 1e-5 relative at every step, or the script exits 1. Model-state bytes per rank (after a
step, before zero_grad) are counted from each side's tensors, every storage once: fxpar's
`runner.memory_stats()`; for torch the parameters, the gradients (DDP with
`gradient_as_bucket_view=True`, so they are its bucket buffers, not a second copy) and the
local optimizer's state.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import fxpar
from harness import (
    GLOBAL_BATCH, GPT_SIZES, OPTIMIZER, SEQ, Side, comparison, distinct_storage_bytes,
    first_mismatch, format_table, global_batches, mean_over_ranks, module_step, progress_line,
    run_interleaved, runner_step, side_by_side_arguments, timing_cell, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

LOSS_RELATIVE = 1e-5


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket MiB")
    parser.add_argument("--models", nargs="+", default=["small", "medium"], choices=list(GPT_SIZES))
    return parser.parse_args()


def torch_state_bytes(ddp: DistributedDataParallel, optimizer: ZeroRedundancyOptimizer) -> int:
    """The torch side's parameters, gradients (views of DDP's buckets) and local optimizer state."""
    tensors = [*ddp.parameters(), *(p.grad for p in ddp.parameters()),
               *(t for s in optimizer.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    return distinct_storage_bytes(t for t in tensors if t is not None)


def bench_model(name: str, zero: int, args: argparse.Namespace):
    config = GPT_SIZES[name]
    torch.manual_seed(0)
    model = GPT(config)
    torch_model = copy.deepcopy(model)
    batches = global_batches(config.vocab_size, args.warmup + args.steps + 1, 1)
    world = int(os.environ["WORLD_SIZE"])
    program = fxpar.compile(model, f"dp={world} zero={zero} bucket_mb={args.bucket_mb:g}", example_inputs=batches[0])
    runner = program.bind(timeout=120)
    fx_optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    local = [runner.local_batch(*b) for b in batches]
    ddp = DistributedDataParallel(torch_model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    zero_optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True, **OPTIMIZER)
    runs = run_interleaved(
        [Side("torch", module_step(ddp, zero_optimizer, local)), Side("fxpar", runner_step(runner, fx_optimizer, local))],
        warmup=args.warmup, steps=args.steps, block=args.block,
    )
    torch_losses = mean_over_ranks(runs["torch"].losses)
    fx_losses = runs["fxpar"].losses
    mismatch = first_mismatch(torch_losses, fx_losses, rel=LOSS_RELATIVE)
    # Memory after one more step, before zero_grad: gradients and optimizer state all held.
    x, y = local[-1]
    ddp(x, y).backward()
    zero_optimizer.step()
    runner.step(x, y)
    fx_optimizer.step()
    memory = runner.memory_stats()
    result = {
        "model": name, "zero": zero, "parameters": program.captured.parameter_count(),
        "fxpar_state_bytes": memory["params"] + memory["grads"] + memory["optimizer"],
        "fxpar_memory": memory, "torch_state_bytes": torch_state_bytes(ddp, zero_optimizer),
        **comparison(runs, "torch", torch_losses, fx_losses, mismatch),
    }
    zero_optimizer.zero_grad()
    fx_optimizer.zero_grad()
    return result, runner


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    results, runner = [], None
    for name in args.models:
        for zero in (1, 2):
            result, runner = bench_model(name, zero, args)
            results.append(result)
            if runner.is_main:
                print(progress_line(f"{name} zero={zero}", result, "torch"), flush=True)
            runner.close()
    if int(os.environ["RANK"]) == 0:
        report(results, args)
    return 0 if all(r["losses_match"] for r in results) else 1


def report(results: list[dict], args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    print(f"\nfxpar dp={world} zero=1/2 vs DDP + ZeroRedundancyOptimizer(AdamW, parameters_as_bucket_view), "
          f"gloo on CPU, torch {torch.__version__}, {torch.get_num_threads()} thread/rank, global batch "
          f"{GLOBAL_BATCH}x{SEQ}, {args.bucket_mb:g} MiB buckets, median of {args.steps} steps after "
          f"{args.warmup} warm-up (max over ranks), load average {os.getloadavg()[1]:.1f} (5 min)")
    header = ["model", "zero", "torch ms [p10-p90]", "fxpar ms [p10-p90]", "fxpar/torch", "paired",
              "CPU ratio", "state MiB torch/fxpar", "losses match"]
    rows = [[r["model"], str(r["zero"]),
             timing_cell(r["torch"]), timing_cell(r["fxpar"]),
             f"{r['ratio']:.3f}", f"{r['paired_ratio']:.3f}", f"{r['cpu_ratio']:.3f}",
             f"{r['torch_state_bytes'] / 2**20:.2f}/{r['fxpar_state_bytes'] / 2**20:.2f}",
             "yes" if r["losses_match"] else "NO"] for r in results]
    print(format_table(header, rows))
    for r in results:
        m = r["fxpar_memory"]
        print(f"  {r['model']} zero={r['zero']}: fxpar params {m['params']:,} B, grads {m['grads']:,} B, "
              f"optimizer {m['optimizer']:,} B ({r['parameters']:,} parameters); max loss rel diff "
              f"{r['max_loss_relative_difference']:.1e}")
    if args.json is not None:
        write_json(args.json, args, results, world_size=world)


if __name__ == "__main__":
    sys.exit(main())
