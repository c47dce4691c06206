"""fxpar tp=2 against Megatron tensor parallelism written by hand: the physical anchor.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_megatron.py --steps 30 --warmup 5
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_megatron.py --compile

bench_tp.py measures fxpar against DTensor, whose per-op dispatch is a cost of its own. This
script measures it against the fastest eager tensor parallelism we know how to write: the
same GPT (examples/gpt.py) with Megatron's layout coded into the model, plain tensors and
direct `torch.distributed.all_reduce` calls, as picotron's `tensor_parallel/` does:

    megatron:  per block, f -> attn.q/k/v column-parallel (local heads) -> attn.o row-parallel
               -> g, and f -> mlp.up column-parallel -> GELU -> mlp.down row-parallel -> g;
               embedding, LayerNorms and the (tied) head replicated, no vocab parallelism.
    fxpar:     `tp=2 tp_rules={...}`, the same layout as explicit rules (bench_tp.RULES).

f and g are Megatron's conjugate operators (Shoeybi et al. 2019, Sec. 3, Fig. 3): f is the
identity forward and an all-reduce backward, g an all-reduce forward and the identity
backward. As with Megatron's fused QKV, one f guards each attention's input (picotron puts one
on each of q, k and v: two more backward all-reduces per block); row-parallel biases are added
once, after g. Both sides then issue the same 4 all-reduces per block (16 per step here).

For each GPT size (bench_tp.py's), both sides start from one seeded model: fxpar compiles a
deep copy, the hand-written side slices its shards from another (q/k/v/up weight and bias by
rows, o/down weight by columns). Both train on the same global batches (every rank sees the
whole batch) with AdamW(lr=1e-3, weight_decay=0.1), PyTorch's default per-tensor
implementation on the CPU. One timed step:

    megatron:  loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    fxpar:     loss = runner.step(x, y);            opt.step(); opt.zero_grad()

With `--compile` both sides run Inductor: fxpar `compile=inductor`, and the hand-written
model under `torch.compile` (Dynamo traces its `dist.all_reduce` calls as functional
collectives).

The sides are timed in alternating blocks (`harness.run_interleaved`); their losses must agree
to 1e-4 relative at every step (in eager mode the sides do the same float ops, so they agree
bit for bit; compiled, each fuses its own graph), or the comparison is void and the script
exits 1. It also prints the largest difference of the
trained weights (shards gathered against `runner.full_state_dict()`). `--breakdown N` times
the phases of N more steps per side; `--profile` prints, on rank 0, a cProfile of 3 steps of
each side timed with main-thread CPU time (waiting for the peer left out).
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import gc
import io
import os
import pstats
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpar
from bench_tp import BATCH, RULES, LocalHeadAttention, count_parameters
from harness import (
    GPT_SIZES, OPTIMIZER, SEQ, Side, comparison, first_mismatch, format_table, global_batches,
    mismatch_message, module_step, progress_line, run_interleaved, runner_step,
    side_by_side_arguments, timing_cell, write_json,
)
from tp_profile import breakdown

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, MLP  # noqa: E402

if TYPE_CHECKING:
    from fxpar.runtime.runner import Runner

LOSS_RELATIVE = 1e-4
COLUMN_PARALLEL = ("attn.q", "attn.k", "attn.v", "mlp.up")  # weight and bias split by rows
ROW_PARALLEL = ("attn.o", "mlp.down")  # weight split by columns, bias replicated


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "medium"], choices=list(GPT_SIZES))
    parser.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                        help="after the run, time the phases of STEPS more steps per side")
    parser.add_argument("--profile", action="store_true",
                        help="after the run, cProfile 3 steps of each side (rank 0 prints)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="both sides compiled by Inductor")
    return parser.parse_args()


# -- Megatron's f and g, and the modules that use them ----------------------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward (picotron's
    `CopyToModelParallelRegion`). Each rank's column shard contributes a partial gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # in place: the gradient is a fresh sum of q/k/v's (or up's)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce of the row-parallel partial sums forward, identity backward
    (picotron's `ReduceFromModelParallelRegion`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)  # reduced in place: x is the fresh output of the local matmul
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class RowParallelLinear(torch.nn.Linear):
    """y = g(x_shard @ W_shard^T) + b: the weight holds this rank's columns, the bias is whole
    and added once, after the reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceFromTensorParallel.apply(F.linear(x, self.weight))  # (B, T, C), summed
        return y if self.bias is None else y + self.bias


class MegatronAttention(LocalHeadAttention):
    """bench_tp's local-head attention (q/k/v hold this rank's heads) behind one f."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(CopyToTensorParallel.apply(x))


class MegatronMLP(MLP):
    """f, then the column shard of up, GELU on the local hidden units, row-parallel down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(CopyToTensorParallel.apply(x))


def megatron_model(model: GPT, rank: int, tp: int) -> tuple[GPT, dict[str, int]]:
    """A copy of `model` holding rank `rank`'s Megatron shards, and {parameter: split dim}."""
    model = copy.deepcopy(model)  # same weights, same tying, separate tensors
    split: dict[str, int] = {}

    def shard(module: torch.nn.Module, path: str, kind: str, dim: int) -> None:
        whole = getattr(module, kind)
        setattr(module, kind, torch.nn.Parameter(whole.detach().chunk(tp, dim)[rank].clone()))
        split[f"{path}.{kind}"] = dim

    for i, block in enumerate(model.h):
        if block.attn.n_head % tp:
            raise ValueError(f"n_head={block.attn.n_head} does not split over tp={tp}")
        block.attn.__class__, block.mlp.__class__ = MegatronAttention, MegatronMLP
        block.attn.n_head //= tp
        for name in COLUMN_PARALLEL:
            linear = block.get_submodule(name)
            shard(linear, f"h.{i}.{name}", "weight", 0)
            if linear.bias is not None:
                shard(linear, f"h.{i}.{name}", "bias", 0)
        for name in ROW_PARALLEL:
            linear = block.get_submodule(name)
            linear.__class__ = RowParallelLinear
            shard(linear, f"h.{i}.{name}", "weight", 1)
    return model, split


def gathered_parameters(model: GPT, split: dict[str, int]) -> dict[str, torch.Tensor]:
    """The whole parameters of the hand-written model (shards all-gathered), by GPT name."""
    whole = {}
    for name, p in model.named_parameters():
        value = p.detach()
        if name in split:
            pieces = [torch.empty_like(value) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, value.contiguous())
            value = torch.cat(pieces, split[name])
        whole[name] = value.clone()
    return whole


def profile_steps(name: str, steps: dict) -> None:
    """cProfile (main-thread CPU) of 3 steps of each side; rank 0 prints the top by own time."""
    for side, step in steps.items():
        dist.barrier()
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        for _ in range(3):
            step()
        profiler.disable()
        if dist.get_rank() == 0:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
            print(f"\n== cProfile, {name}, {side}, 3 steps, rank 0, by own time ==")
            print(text.getvalue()[-6000:])


# -- the comparison ---------------------------------------------------------------------------

def bench_model(name: str, args: argparse.Namespace) -> tuple[dict, Runner]:
    config = GPT_SIZES[name]
    tp = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(args.seed)
    model = GPT(config)
    batches = global_batches(config.vocab_size, args.warmup + args.steps + 10, args.seed + 1,
                             batch=BATCH)

    plan = f"tp={tp} tp_rules={RULES}" + (" compile=inductor" if args.compile else "")
    program = fxpar.compile(copy.deepcopy(model), plan, example_inputs=batches[0])
    runner = program.bind(timeout=120)  # the first bind creates the process group
    fx_optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    hand, split = megatron_model(model, dist.get_rank(), tp)
    hand_optimizer = torch.optim.AdamW(hand.parameters(), **OPTIMIZER)

    hand_step = module_step(torch.compile(hand) if args.compile else hand, hand_optimizer, batches)
    fx_step = runner_step(runner, fx_optimizer, batches)

    runs = run_interleaved([Side("megatron", hand_step), Side("fxpar", fx_step)],
                           warmup=args.warmup, steps=args.steps, block=args.block)
    hand_losses, fx_losses = runs["megatron"].losses, runs["fxpar"].losses
    mismatch = first_mismatch(hand_losses, fx_losses, rel=LOSS_RELATIVE)
    fx_state, hand_state = runner.full_state_dict(), gathered_parameters(hand, split)
    result = {
        "model": name,
        "config": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")},
        "parameters": count_parameters(model),
        "max_weight_abs_difference": max(
            (hand_state[n] - fx_state[n]).abs().max().item() for n in hand_state),
        **comparison(runs, "megatron", hand_losses, fx_losses, mismatch),
    }
    if mismatch is not None and dist.get_rank() == 0:
        print(mismatch_message(name, mismatch, ("megatron", "fxpar"), rel=LOSS_RELATIVE)
              + f" (max {result['max_loss_relative_difference']:.2e})", flush=True)

    extra = batches[args.warmup + args.steps:]  # batches for steps after the compared ones
    if args.breakdown:
        sides = {"megatron": (hand, hand_optimizer, None), "fxpar": (None, fx_optimizer, runner)}
        result["breakdown"] = breakdown(sides, extra, repeats=args.breakdown)
    if args.profile:
        profile_steps(name, {"megatron": lambda: hand_step(0), "fxpar": lambda: fx_step(0)})
    return result, runner


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # 2 ranks on 2 cores: one compute thread each
    results, runner = [], None
    for name in args.models:
        result, runner = bench_model(name, args)
        results.append(result)
        if dist.get_rank() == 0:
            print(progress_line(name, result, "megatron"), flush=True)
        if not result["losses_match"]:
            break  # the comparison is void: abort
    is_main = dist.get_rank() == 0
    runner.close()  # destroys the process group (the earlier runners share it)
    del runner  # see bench_tp.main: free the gloo group now, not at interpreter exit
    gc.collect()
    if is_main:
        report(results, args)
    return 0 if all(r["losses_match"] for r in results) else 1


def report(results: list[dict], args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    mode = ", both compiled by Inductor" if args.compile else ""
    print(f"\nfxpar tp={world} (explicit Megatron rules) vs Megatron TP by hand{mode}, gloo on CPU, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread/rank, batch {BATCH}x{SEQ} "
          f"(whole batch on every rank), median of {args.steps} steps after {args.warmup} "
          f"warm-up, block {args.block}, load average {os.getloadavg()[1]:.1f} (5 min)")
    for r in results:
        c = r["config"]
        print(f"\n{r['model']}: {c['n_layer']} layers, {c['n_embd']} wide, {c['n_head']} heads, "
              f"{r['parameters']:,} parameters; losses match: "
              f"{'yes' if r['losses_match'] else 'NO'} (max rel diff "
              f"{r['max_loss_relative_difference']:.1e}, loss {r['first_loss']:.4f} -> "
              f"{r['last_loss']:.4f}); max |weight diff| after training "
              f"{r['max_weight_abs_difference']:.1e}")
        rows = [["hand-written", timing_cell(r["megatron"]), timing_cell(r["megatron_cpu"]),
                 "1", "1", "1"],
                ["fxpar", timing_cell(r["fxpar"]), timing_cell(r["fxpar_cpu"]), *(
                    f"{r[k]:.3f}" for k in ("ratio", "paired_ratio", "cpu_ratio"))]]
        print(format_table(["side", "wall ms [p10-p90]", "CPU ms [p10-p90]", "wall / hand",
                            "paired", "CPU / hand"], rows))
        if "breakdown" in r:
            print("  breakdown, median ms wall/CPU: " + "; ".join(
                f"{s} " + ", ".join(f"{p} {v['wall_ms']:.1f}/{v['cpu_ms']:.1f}"
                                    for p, v in r["breakdown"][s].items()) for s in r["breakdown"]))
    print("\n  wall: step time, max over ranks; CPU: main-thread CPU time per step "
          "(time.thread_time, mean over ranks), which leaves out waiting; paired: median over k "
          "of fxpar step k / hand-written step k; target wall / hand <= 1.02")
    if args.json is not None:
        write_json(args.json, args, results, world_size=world)


if __name__ == "__main__":
    sys.exit(main())
