"""fxpar compile=inductor against torch.compile: same model, weights, data and optimizer.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_inductor.py
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_inductor.py

At world 1: fxpar `dp=1 compile=inductor` against `torch.compile(model)`, both Inductor.
At world 2: fxpar `dp=2 compile=inductor` against DistributedDataParallel around a
`torch.compile`d model (DDP's buckets the same size as fxpar's). A timed step is everything a
training loop does (forward, backward, AdamW, zero_grad), the sides in alternating blocks
(`harness.run_interleaved`); the global-batch losses must agree to 1e-4 relative at every step
(both sides fuse with Inductor, but not the same graphs: fxpar's is the captured aten graph,
torch.compile's Dynamo's trace of the module, so their fp32 sums may round differently) or
the script exits 1.

Beside them, fxpar's own prediction of its step: `program.estimate("cpu")` (`time.total`,
the compiled step priced by the kernels Inductor runs: `cost.fused_kernels`) on the `cpu`
profile measured at this thread count, and the measured median over it.

Compile time: each side's first step, compile included, with Inductor's on-disk and in-memory
caches off (`fx_graph_cache`, `enable_autograd_cache`), so that neither side reads what the
other compiled; fxpar's also counts `fxpar.compile` (capture and passes) and bind. The ratio is
fxpar's over torch.compile's.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fxpar
from harness import (
    GLOBAL_BATCH, GPT_SIZES, OPTIMIZER, SEQ, Side, comparison, first_mismatch, format_table,
    global_batches, mean_over_ranks, mismatch_message, module_step, run_interleaved, run_models,
    runner_step, side_by_side_arguments, timing_cell, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

LOSS_RELATIVE = 1e-4
BUCKET_MB = 25.0


def first_step_seconds(step) -> float:
    """Wall seconds of training step 0 (the compile), after a barrier, max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    step(0)
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def estimated_step(program) -> float:
    """fxpar's predicted step on the measured `cpu` profile. Rank 0 measures the profile (once:
    it is cached) while the others wait, so that no two ranks measure the machine at once."""
    from fxpar.cost.profiles import hardware_profile

    if dist.get_rank() == 0:
        hardware_profile("cpu")
    dist.barrier()
    return program.estimate("cpu").time["total"]


def bench_model(name: str, args) -> tuple[dict, object]:
    world = int(os.environ["WORLD_SIZE"])
    config = GPT_SIZES[name]
    torch.manual_seed(args.seed)
    model = GPT(config)
    native_model = copy.deepcopy(model)
    batches = global_batches(config.vocab_size, 1 + args.warmup + args.steps, args.seed + 1)

    start = time.perf_counter()
    program = fxpar.compile(model, f"dp={world} bucket_mb={BUCKET_MB:g} compile=inductor", batches[0])
    runner = program.bind(timeout=600)
    planning = time.perf_counter() - start  # capture, passes, bind: part of fxpar's compile time
    estimated = estimated_step(program)
    fx_optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    local = [runner.local_batch(*b) for b in batches]
    compiled = torch.compile(native_model)
    native = compiled if world == 1 else DistributedDataParallel(compiled, bucket_cap_mb=BUCKET_MB)
    native_optimizer = torch.optim.AdamW(native_model.parameters(), **OPTIMIZER)
    native_step = module_step(native, native_optimizer, local)
    fxpar_step = runner_step(runner, fx_optimizer, local)

    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compile_seconds = {"torch": first_step_seconds(native_step),
                           "fxpar": planning + first_step_seconds(fxpar_step)}
    shifted = [Side("torch", lambda i: native_step(i + 1)), Side("fxpar", lambda i: fxpar_step(i + 1))]
    runs = run_interleaved(shifted, warmup=args.warmup, steps=args.steps, block=args.block)
    native_losses = mean_over_ranks(runs["torch"].losses) if world > 1 else runs["torch"].losses
    fx_losses = runs["fxpar"].losses
    mismatch = first_mismatch(native_losses, fx_losses, rel=LOSS_RELATIVE)
    if mismatch is not None and runner.is_main:
        print(mismatch_message(name, mismatch, ("torch", "fxpar"), rel=LOSS_RELATIVE), flush=True)
    return {
        "model": name,
        "parameters": program.captured.parameter_count(),
        "compile_seconds": compile_seconds,
        "compile_ratio": compile_seconds["fxpar"] / compile_seconds["torch"],
        "estimated_seconds": estimated,
        **comparison(runs, "torch", native_losses, fx_losses, mismatch),
    }, runner


def report(results: list[dict], args) -> None:
    world = int(os.environ["WORLD_SIZE"])
    native = "torch.compile" if world == 1 else "DDP(torch.compile)"
    header = ["model", "params", f"{native} ms [p10-p90]", "fxpar ms [p10-p90]", "fxpar/torch", "paired",
              "CPU ratio", "first step s torch/fxpar", "compile ratio", "fxpar est ms", "measured/est",
              "losses match"]
    rows = [[r["model"], f"{r['parameters']:,}", timing_cell(r["torch"]), timing_cell(r["fxpar"]),
             f"{r['ratio']:.3f}", f"{r['paired_ratio']:.3f}", f"{r['cpu_ratio']:.3f}",
             f"{r['compile_seconds']['torch']:.1f}/{r['compile_seconds']['fxpar']:.1f}",
             f"{r['compile_ratio']:.2f}", f"{1e3 * r['estimated_seconds']:.1f}",
             f"{r['fxpar']['median_ms'] / (1e3 * r['estimated_seconds']):.2f}", "yes" if r["losses_match"] else "NO"]
            for r in results]
    print()
    print(f"fxpar dp={world} compile=inductor vs {native}, gloo on CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread/rank, global batch {GLOBAL_BATCH}x{SEQ}, AdamW, "
          f"median of {args.steps} steps after {args.warmup} warm-up (max over ranks), "
          f"load average {os.getloadavg()[1]:.1f} (5 min)")
    print(format_table(header, rows))
    print("  first step: compile included, Inductor's caches off (fxpar's: + fxpar.compile and bind); "
          "compile ratio: fxpar / torch")
    if args.json is not None:
        write_json(args.json, args, results, world_size=world)


def main() -> int:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "medium"], choices=list(GPT_SIZES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    return run_models(args.models, bench_model, args, native="torch", report=report)


if __name__ == "__main__":
    sys.exit(main())
