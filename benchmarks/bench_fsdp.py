"""fxpar ZeRO-3 against FSDP2 (`fully_shard` per block): step time and model-state bytes.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_fsdp.py --steps 30 --warmup 5
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_fsdp.py --compile

PyTorch's own ZeRO-3 is FSDP2: `torch.distributed.fsdp.fully_shard` on each transformer block
and on the root, which makes every parameter a DTensor sharded on dim 0, all-gathers a
block's parameters before its forward (prefetching the next), frees them after it and again
after its backward (its default `reshard_after_forward=None`: True for the blocks, False for
the root, whose parameters stay gathered from forward to backward), and reduce-scatters the
block's gradients. fxpar `dp=N zero=3` does the same moves with one graph op per layer
(`passes.zero3`), with its defaults `prefetch=1 reshard_after_forward=true`. One timed step:

    torch:  loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    fxpar:  loss = runner.step(x, y);            opt.step(); opt.zero_grad()

With `--compile` both sides run Inductor: fxpar `compile=inductor` (each rank's forward and
backward compiled whole, the gathers inside the graph: `ops.recomputed_gathers`), FSDP2 as
torchtitan runs it, `torch.compile` on each block before `fully_shard`.

Same weights, batches and AdamW(lr=1e-3, weight_decay=0.1) on both sides, timed in
alternating blocks (`harness.run_interleaved`); the global-batch losses must agree to 1e-5
relative at every step (1e-4 compiled: the two sides fuse different graphs, whose fp32 sums
may round differently), or the script exits 1. Model-state bytes per rank (after a step,
before zero_grad) are counted from each side's local tensors, every storage once: fxpar's
`runner.memory_stats()`; for FSDP2 the local shards of the parameters, of their gradients and
of the optimizer's state (`DTensor.to_local()`).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fxpar
from harness import (
    GLOBAL_BATCH, GPT_SIZES, OPTIMIZER, SEQ, Side, comparison, distinct_storage_bytes,
    first_mismatch, format_table, global_batches, mean_over_ranks, module_step, progress_line,
    run_interleaved, runner_step, side_by_side_arguments, timing_cell, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

LOSS_RELATIVE = {False: 1e-5, True: 1e-4}  # by --compile (module doc)


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "medium"], choices=list(GPT_SIZES))
    parser.add_argument("--compile", action="store_true", help="both sides compiled by Inductor")
    return parser.parse_args()


def fsdp_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """FSDP2's local shards of parameters, gradients and optimizer state, each storage once."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()),
               *(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    return distinct_storage_bytes(t.to_local() if isinstance(t, DTensor) else t
                                  for t in tensors if t is not None)


def bench_model(name: str, args: argparse.Namespace):
    config = GPT_SIZES[name]
    torch.manual_seed(0)
    model = GPT(config)
    torch_model = copy.deepcopy(model)
    batches = global_batches(config.vocab_size, args.warmup + args.steps + 1, 1)
    world = int(os.environ["WORLD_SIZE"])
    plan = f"dp={world} zero=3" + (" compile=inductor" if args.compile else "")
    program = fxpar.compile(model, plan, example_inputs=batches[0])
    runner = program.bind(timeout=120)
    fx_optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    local = [runner.local_batch(*b) for b in batches]
    mesh = init_device_mesh("cpu", (world,))
    for block in torch_model.h:
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(torch_model, mesh=mesh)
    torch_optimizer = torch.optim.AdamW(torch_model.parameters(), **OPTIMIZER)
    runs = run_interleaved(
        [Side("torch", module_step(torch_model, torch_optimizer, local)),
         Side("fxpar", runner_step(runner, fx_optimizer, local))],
        warmup=args.warmup, steps=args.steps, block=args.block,
    )
    torch_losses = mean_over_ranks(runs["torch"].losses)
    fx_losses = runs["fxpar"].losses
    mismatch = first_mismatch(torch_losses, fx_losses, rel=LOSS_RELATIVE[args.compile])
    # Memory after one more step, before zero_grad: gradients and optimizer state all held.
    x, y = local[-1]
    torch_model(x, y).backward()
    torch_optimizer.step()
    runner.step(x, y)
    fx_optimizer.step()
    memory = runner.memory_stats()
    result = {
        "model": name, "parameters": program.captured.parameter_count(),
        "fxpar_state_bytes": memory["params"] + memory["grads"] + memory["optimizer"],
        "fxpar_memory": memory, "torch_state_bytes": fsdp_state_bytes(torch_model, torch_optimizer),
        **comparison(runs, "torch", torch_losses, fx_losses, mismatch),
    }
    torch_optimizer.zero_grad()
    fx_optimizer.zero_grad()
    return result, runner


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    results, runner = [], None
    for name in args.models:
        result, runner = bench_model(name, args)
        results.append(result)
        if runner.is_main:
            print(progress_line(name, result, "torch", label="FSDP2"), flush=True)
        runner.close()
    if int(os.environ["RANK"]) == 0:
        report(results, args)
    return 0 if all(r["losses_match"] for r in results) else 1


def report(results: list[dict], args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    mode = " compile=inductor vs FSDP2 + torch.compile per block" if args.compile else " vs FSDP2"
    print(f"\nfxpar dp={world} zero=3{mode}, fully_shard per block + root (AdamW), gloo on CPU, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread/rank, global batch "
          f"{GLOBAL_BATCH}x{SEQ}, median of {args.steps} steps after {args.warmup} warm-up (max over "
          f"ranks), load average {os.getloadavg()[1]:.1f} (5 min)")
    header = ["model", "FSDP2 ms [p10-p90]", "fxpar ms [p10-p90]", "fxpar/FSDP2", "paired",
              "CPU ratio", "state MiB FSDP2/fxpar", "losses match"]
    rows = [[r["model"],
             timing_cell(r["torch"]), timing_cell(r["fxpar"]),
             f"{r['ratio']:.3f}", f"{r['paired_ratio']:.3f}", f"{r['cpu_ratio']:.3f}",
             f"{r['torch_state_bytes'] / 2**20:.2f}/{r['fxpar_state_bytes'] / 2**20:.2f}",
             "yes" if r["losses_match"] else "NO"] for r in results]
    print(format_table(header, rows))
    for r in results:
        print(f"  {r['model']}: {r['parameters']:,} parameters; max loss rel diff "
              f"{r['max_loss_relative_difference']:.1e}")
    if args.json is not None:
        write_json(args.json, args, results, world_size=world)


if __name__ == "__main__":
    sys.exit(main())
