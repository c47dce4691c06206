"""fxpar tp=2 against DTensor `parallelize_module` tp=2: same model, weights, data, optimizer.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --steps 30 --warmup 5

For each GPT size, three sides start from the same initial weights (one seeded model, deep-
copied three times), train on the same global batches (tensor parallelism only: every rank
sees the whole batch) with AdamW(lr=1e-3, weight_decay=0.1), PyTorch's default
implementation for the device (on the CPU: the per-tensor for-loop, for both sides; DTensor
parameters need no `foreach=False`):

    dtensor:     Megatron's layout by hand with torch.distributed.tensor.parallel: per block
                 attn.q/k/v and mlp.up ColwiseParallel, attn.o and mlp.down RowwiseParallel;
                 embedding and (tied) head replicated, no plan.
    fxpar:       `tp=2 tp_rules={...}`, the same layout as explicit rules.
    fxpar-auto:  plain `tp=2`: the auto rules, which also shard the tied embedding/head along
                 the vocabulary (vocab-parallel embedding and cross entropy).

One timed step is everything a training loop does:

    dtensor:  loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    fxpar:    loss = runner.step(x, y);            opt.step(); opt.zero_grad()

The DTensor side needs model edits that fxpar does not: examples/gpt.py's attention reshapes
with the *global* head count (`view(B, T, self.n_head, C // self.n_head)`), which is wrong
on a rank's column shard of q/k/v. As torchtitan does (`attention.n_heads = n_heads // tp`),
the DTensor copy's attention modules get the local head count and `view(B, T, -1)` to
re-assemble the local heads (`LocalHeadAttention` below); the weights are untouched.

The sides are timed in alternating blocks (`harness.run_interleaved`); their losses must agree
to 1e-4 relative at every step (both reduce exactly: they agree to ~2e-7), or the comparison
is void and the script stops and exits 1. It also prints the largest difference of the trained
weights (DTensor's `full_tensor()` against `runner.full_state_dict()`); a few 1e-5 is expected:
AdamW's first steps divide each gradient by its own magnitude, so rounding noise in gradients
that are zero in exact arithmetic (attn.k.bias: softmax ignores a per-query constant) or
nearly zero moves weights by a fraction of lr.

After the compared steps: `--breakdown N` times the phases of N more steps of each side (wall
and main-thread CPU); `--profile` prints, on rank 0, a torch.profiler operator table of 3 steps
of each side, a cProfile of 3 steps of DTensor and of fxpar, and the CPU cost of one in-place
op on a DTensor parameter against its local shard.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module,
)
from torch.distributed.tensor.placement_types import Replicate

import fxpar
from tp_profile import breakdown, profile_sides
from harness import (
    GPT_SIZES, OPTIMIZER, SEQ, Side, first_mismatch, format_table, global_batches,
    mismatch_message, module_step, paired_ratio, run_interleaved, runner_step,
    side_by_side_arguments, timing_cell, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, CausalSelfAttention  # noqa: E402

if TYPE_CHECKING:
    from fxpar.runtime.runner import Runner

BATCH = 8
MODELS = GPT_SIZES
LOSS_RELATIVE = 1e-4
# Megatron's layout by hand, the same as the DTensor plan below.
RULES = ('{"h.*.attn.[qkv]":"colwise","h.*.attn.o":"rowwise",'
         '"h.*.mlp.up":"colwise","h.*.mlp.down":"rowwise"}')
SIDES = ("dtensor", "fxpar", "fxpar-auto")


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "medium"], choices=list(MODELS))
    parser.add_argument("--dtensor-shared-input", action="store_true",
                        help="also wrap each attention's input once (PrepareModuleInput, "
                             "use_local_output=False), so q/k/v share one backward all-reduce "
                             "instead of three; not the plan torchtitan uses without SP")
    parser.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                        help="after the run, time the phases of STEPS more steps per side "
                             "(forward, fwd+bwd, optimizer; wall and CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="after the run, profile each side (rank 0 prints the tables)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class LocalHeadAttention(CausalSelfAttention):
    """examples/gpt.py's attention for a rank's column shard of q/k/v (DTensor side only).

    `n_head` is the local head count (global // tp) and views use -1 for the width, so the
    same code runs on the local tensors ColwiseParallel returns (torchtitan's edit).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q = self.q(x).view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh local, T, hs)
        k = self.k(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # the local heads side by side
        return self.o(y)


def dtensor_model(model: GPT, mesh: DeviceMesh, *, shared_input: bool) -> GPT:
    """A copy of `model` with Megatron's layout via parallelize_module (same full weights)."""
    model = copy.deepcopy(model)  # same weights, same tying, separate tensors
    tp = mesh.size()
    for block in model.h:
        attn = block.attn
        assert attn.n_head % tp == 0, (attn.n_head, tp)
        attn.__class__ = LocalHeadAttention
        attn.n_head //= tp
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(),
        }
        if shared_input:
            plan["attn"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                use_local_output=False,
            )
        parallelize_module(block, mesh, plan)
    return model


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters of the DTensor model (each tied group once), keyed like the GPT's."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def dtensor_comm_counts(step) -> dict[str, int]:
    """Collectives one DTensor step issues (CommDebugMode counts functional collectives)."""
    import warnings

    from torch.distributed.tensor.debug import CommDebugMode

    with warnings.catch_warnings(), CommDebugMode() as mode:
        # CommDebugMode's global module backward hooks warn that the inputs need no grad.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        step()
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def bench_model(name: str, args: argparse.Namespace, mesh_box: list) -> tuple[dict, Runner]:
    config = MODELS[name]
    tp = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(args.seed)
    model = GPT(config)
    # Each side gets its own copy: fxpar's rank module reuses the model's replicated tensors.
    fx_model, auto_model = copy.deepcopy(model), copy.deepcopy(model)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = global_batches(config.vocab_size, args.warmup + args.steps + 10, args.seed + 1,
                             batch=BATCH)

    program = fxpar.compile(fx_model, f"tp={tp} tp_rules={RULES}", example_inputs=batches[0])
    runner = program.bind(timeout=120)
    auto_program = fxpar.compile(auto_model, f"tp={tp}", example_inputs=batches[0])
    auto_runner = auto_program.bind(timeout=120)  # reuses the process group
    if not mesh_box:
        mesh_box.append(init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
    mesh = mesh_box[0]

    dt_model = dtensor_model(model, mesh, shared_input=args.dtensor_shared_input)
    # parallelize_module shards the full weights: check that it did so exactly.
    for pname, whole in full_parameters(dt_model).items():
        assert torch.equal(whole, reference[pname]), pname

    dt_optimizer = torch.optim.AdamW(dt_model.parameters(), **OPTIMIZER)
    fx_optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    auto_optimizer = auto_runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    local = [runner.local_batch(*b) for b in batches]  # unchanged for dp=1: the whole batch

    dt_step = module_step(dt_model, dt_optimizer, local)
    fx_step = runner_step(runner, fx_optimizer, local)
    auto_step = runner_step(auto_runner, auto_optimizer, local)

    runner.reset_comm_stats()
    auto_runner.reset_comm_stats()
    runs = run_interleaved(
        [Side("dtensor", dt_step), Side("fxpar", fx_step), Side("fxpar-auto", auto_step)],
        warmup=args.warmup, steps=args.steps, block=args.block,
    )
    steps_run = args.warmup + args.steps
    dt_losses = runs["dtensor"].losses
    mismatches = {
        side: first_mismatch(dt_losses, runs[side].losses, rel=LOSS_RELATIVE)
        for side in ("fxpar", "fxpar-auto")
    }
    max_rel = {
        side: max(abs(a - b) / max(abs(a), abs(b)) for a, b in zip(dt_losses, runs[side].losses))
        for side in ("fxpar", "fxpar-auto")
    }
    # Read before gathering the state below, whose all-gathers comm_stats also counts.
    fx_stats, auto_stats = runner.comm_stats(), auto_runner.comm_stats()
    # Trained weights: DTensor's full parameters against fxpar's gathered state.
    dt_state = full_parameters(dt_model)
    weight_diff = {}
    for side, r in (("fxpar", runner), ("fxpar-auto", auto_runner)):
        state = r.full_state_dict()
        weight_diff[side] = max(
            (dt_state[n] - state[n]).abs().max().item() for n in dt_state
        )

    def per_step(stats: dict) -> dict[str, float]:
        return {kind: e["count"] / steps_run for kind, e in stats.items()}

    # One more DTensor step, after the compared ones, to count its collectives.
    dt_comm = dtensor_comm_counts(lambda: dt_step(steps_run))
    result = {
        "model": name,
        "config": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")},
        "parameters": count_parameters(model),
        "fxpar_collectives_per_step": per_step(fx_stats),
        "auto_collectives_per_step": per_step(auto_stats),
        "dtensor_collectives_per_step": dt_comm,
        "losses_match": all(m is None for m in mismatches.values()),
        "max_loss_relative_difference": max_rel,
        "max_weight_abs_difference": weight_diff,
        "first_loss": dt_losses[0],
        "last_loss": dt_losses[-1],
    }
    for side in SIDES:
        result[side] = runs[side].timing.to_dict()
        result[f"{side}_cpu"] = runs[side].cpu.to_dict()
    for side in ("fxpar", "fxpar-auto"):
        result[f"{side}_ratio"] = runs[side].timing.median / runs["dtensor"].timing.median
        result[f"{side}_paired"] = paired_ratio(runs["dtensor"].timing, runs[side].timing)
        result[f"{side}_cpu_ratio"] = runs[side].cpu.median / runs["dtensor"].cpu.median
    for side, mismatch in mismatches.items():
        if mismatch is not None and runner.is_main:
            print(mismatch_message(name, mismatch, ("dtensor", side), rel=LOSS_RELATIVE),
                  flush=True)

    extra = local[steps_run + 1:]  # batches for the steps after the compared ones
    sides = {"dtensor": (dt_model, dt_optimizer, None),
             "fxpar": (None, fx_optimizer, runner),
             "fxpar-auto": (None, auto_optimizer, auto_runner)}
    if args.breakdown:
        result["breakdown"] = breakdown(sides, extra, repeats=args.breakdown)
    if args.profile:
        profile_sides(name, sides, extra, runner.is_main)
    return result, runner


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # 2 ranks on 2 cores: one compute thread each
    results, runner, mesh_box = [], None, []
    for name in args.models:
        result, runner = bench_model(name, args, mesh_box)
        results.append(result)
        if runner.is_main:
            print(f"{name}: dtensor {result['dtensor']['median_ms']:.1f} ms, fxpar "
                  f"{result['fxpar']['median_ms']:.1f} ms ({result['fxpar_ratio']:.3f}), "
                  f"fxpar auto {result['fxpar-auto']['median_ms']:.1f} ms "
                  f"({result['fxpar-auto_ratio']:.3f})", flush=True)
        if not result["losses_match"]:
            break  # the comparison is void: abort
    is_main = runner.is_main
    runner.close()  # destroys the process group (the other runners and the mesh share it)
    # Runner.close() leaves the runner holding the gloo ProcessGroup (its RankGroup handles),
    # so the group would only be freed at interpreter exit, where a group that ran
    # all_gather (full_state_dict above) intermittently dies with "terminate called without
    # an active exception" (SIGABRT, exit 1). Dropping the last references frees it now.
    del runner
    mesh_box.clear()
    gc.collect()
    if is_main:
        report(results, args)
    return 0 if all(r["losses_match"] for r in results) else 1


def report(results: list[dict], args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    header = ["model", "params", "DTensor ms [p10-p90]", "fxpar ms (rules)", "fxpar ms (auto)",
              "rules/DTensor", "paired", "auto/DTensor", "paired", "CPU ms DT/rules/auto",
              "CPU ratio rules", "CPU ratio auto", "losses match"]
    rows = []
    for r in results:
        rows.append([
            r["model"], f"{r['parameters']:,}", timing_cell(r["dtensor"]), timing_cell(r["fxpar"]),
            timing_cell(r["fxpar-auto"]),
            f"{r['fxpar_ratio']:.3f}", f"{r['fxpar_paired']:.3f}",
            f"{r['fxpar-auto_ratio']:.3f}", f"{r['fxpar-auto_paired']:.3f}",
            "/".join(f"{r[s + '_cpu']['median_ms']:.1f}" for s in SIDES),
            f"{r['fxpar_cpu_ratio']:.3f}", f"{r['fxpar-auto_cpu_ratio']:.3f}",
            "yes" if r["losses_match"] else "NO",
        ])
    print()
    print(f"fxpar tp={world} vs DTensor parallelize_module tp={world}, gloo on CPU, torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread/rank, batch {BATCH}x{SEQ} "
          f"(whole batch on every rank), median of {args.steps} steps after {args.warmup} "
          f"warm-up (max over ranks), block {args.block}, DTensor shared attention input "
          f"{args.dtensor_shared_input}, load average {os.getloadavg()[1]:.1f} (5 min)")
    print(format_table(header, rows))
    print("  rules: fxpar with the explicit Megatron rules (same layout as DTensor); auto: plain "
          f"tp={world} (embedding/head vocab-parallel too). ratio: of the medians; paired: "
          "median over k of fxpar step k / DTensor step k; CPU: median main-thread CPU time per "
          "step (time.thread_time, mean over ranks)")
    for r in results:
        rel, wd = r["max_loss_relative_difference"], r["max_weight_abs_difference"]
        print(f"  {r['model']}: max loss rel diff vs DTensor rules {rel['fxpar']:.1e}, auto "
              f"{rel['fxpar-auto']:.1e}; max |weight diff| after training rules "
              f"{wd['fxpar']:.1e}, auto {wd['fxpar-auto']:.1e}; loss {r['first_loss']:.4f} -> "
              f"{r['last_loss']:.4f}")
        fmt = lambda d: ", ".join(f"{k} {v:g}" for k, v in sorted(d.items()))  # noqa: E731
        print(f"    collectives per step: DTensor [{fmt(r['dtensor_collectives_per_step'])}], "
              f"fxpar rules [{fmt(r['fxpar_collectives_per_step'])}], auto "
              f"[{fmt(r['auto_collectives_per_step'])}]")
        if "breakdown" in r:
            b = r["breakdown"]
            print("    breakdown, median ms wall/CPU: " + "; ".join(
                f"{s} " + ", ".join(f"{p} {v['wall_ms']:.1f}/{v['cpu_ms']:.1f}"
                                    for p, v in b[s].items()) for s in SIDES))
    if args.json is not None:
        write_json(args.json, args, results, world_size=world)


if __name__ == "__main__":
    sys.exit(main())
