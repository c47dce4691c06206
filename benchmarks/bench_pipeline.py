"""fxpar pp=2 against torch.distributed.pipelining, and the measured bubble against the simulator.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_pipeline.py

Two measurements per GPT size and schedule (1F1B, GPipe and ZB-H1, 8 microbatches by default):

1. Side by side. The same seeded GPT trains under fxpar (`pp=2 mb=8 schedule=...`, automatic
   cut) and under torch.distributed.pipelining (`pipeline(..., split_spec={cut: BEGINNING})`
   with `Schedule1F1B` / `ScheduleGPipe` / `ScheduleInterleavedZeroBubble`, torch's ZB1P, with
   one stage per rank), cut at the block where fxpar cut. One timed step:

       fxpar:  loss = runner.step(x, y);                              opt.step(); opt.zero_grad()
       torch:  schedule.step(x) (rank 0) / schedule.step(target=y, losses=l) (rank 1),
               all-reduce of the tied embedding/head gradient,        opt.step(); opt.zero_grad()

   torch's pipeline computes logits; the schedule's `loss_fn` is the same cross entropy that
   GPT.forward ends with, averaged per microbatch, and `scale_grads=True` divides gradients by
   the microbatch count as fxpar's `loss / microbatches` does. torch's `pipeline` REPLICATEs the
   tied `wte.weight` / `lm_head.weight` into both stages and leaves their gradients apart, so
   the torch side all-reduces them, which is what fxpar does for tied parameters; without it
   the two sides would not train the same model. `return_outputs=False` on the torch side:
   fxpar does not concatenate the logits either. fxpar's step also sums the loss over the
   pipeline and returns it as a float on every rank (one 4-byte all-reduce); torch's loss stays
   on the last stage. Both sides use AdamW(lr=1e-3, weight_decay=0.1) over their rank's
   parameters. The sides alternate in blocks (`harness.run_interleaved`); their global losses
   must agree to 1e-4 relative at every step or the script exits 1.

With `--compile` fxpar runs `compile=inductor` against torch's eager schedules (torch's
pipelining fails on a compiled model under its zero-bubble schedules, pytorch#161904); under
ZB-H1 fxpar compiles the stretches between each stage's deferred linears
(`runtime.compiled_segments`).

2. The bubble. More fxpar steps with `runner.record_timeline = True`; both ranks' timelines
   go to rank 0 (`dist.all_gather_object`). A step's time T runs from the earliest action start
   to the latest action end over both ranks; a rank's idle fraction is 1 - busy / T; a step's
   is the mean over ranks, and the reported one is the median step's. A rank idles only while it waits for a peer's data (and before its
   first and after its last action); busy is its timeline spans plus the executor's work
   between actions (posting the next receives). The simulator's prediction is
   `simulate(program.schedule, F, B, comm_cost=c).bubble_fraction` with F and B each stage's
   median busy time per action, for three transfer costs c: none; the median time of one
   boundary-sized gloo transfer to a waiting receive while the sender computes (a ping
   measured just before, in the same job); and the median transfer latency observed in the timed steps (producer's end
   to the end of the consumer's wait; the script times the waits by wrapping this runner's
   `communicator.exchange`, fxpar is not changed). To explain a gap it also prints a replay of
   every step through the simulator's rules with each action's own duration (what the
   variance of the compute alone explains), and the same idle fraction on the torch side
   (spans of its stage's `forward_one_chunk` / `backward_one_chunk`).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

import fxpar
from fxpar.ir import meta
from bubble import fxpar_bubble, p2p_latency, torch_bubble
from harness import (
    GLOBAL_BATCH, GPT_SIZES, OPTIMIZER, SEQ, Side, comparison, first_mismatch, format_table,
    global_batches, mismatch_message, progress_line, run_interleaved, side_by_side_arguments,
    sum_over_ranks, timing_cell, write_json,
)
from torch_pipeline import TORCH_SCHEDULES, GPTLogits, TorchPipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT  # noqa: E402

MODELS = GPT_SIZES
LOSS_RELATIVE = 1e-4


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--bubble-steps", type=int, default=20,
                        help="timeline-recording steps per side for the bubble (>= 1)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=["small", "medium"], choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "zb-h1"],
                        choices=list(TORCH_SCHEDULES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="fxpar compile=inductor (module doc)")
    args = parser.parse_args()
    if args.bubble_steps < 1:
        parser.error(f"--bubble-steps {args.bubble_steps}: the bubble needs at least one recorded step")
    return args


def blocks_of(stage) -> set[str]:
    """The transformer blocks ("h.N") whose ops a fxpar stage graph runs."""
    found = set()
    for node in stage.graph_module.graph.nodes:
        parts = meta.module_path(node).split(".")
        if node.op == "call_function" and len(parts) >= 2 and parts[0] == "h":
            found.add(f"h.{parts[1]}")
    return found


def fxpar_cut(program) -> str:
    """The block fxpar's second stage starts with (pp=2), read from the stage graphs."""
    first, second = blocks_of(program.stages[0]), blocks_of(program.stages[1])
    if first & second or not second:
        raise RuntimeError(f"cannot read fxpar's cut: stage 0 {first}, stage 1 {second}")
    return min(second, key=lambda name: int(name.split(".")[1]))


def bench(name: str, schedule_name: str, args: argparse.Namespace) -> tuple[dict, object]:
    config = MODELS[name]
    torch.manual_seed(args.seed)
    model = GPT(config)
    torch_model = GPTLogits(config)
    torch_model.load_state_dict(copy.deepcopy(model.state_dict()))
    batches = global_batches(config.vocab_size, args.warmup + args.steps, args.seed + 1)

    plan = f"pp=2 mb={args.microbatches} schedule={schedule_name}" + (" compile=inductor" if args.compile else "")
    program = fxpar.compile(model, plan, example_inputs=batches[0])
    runner = program.bind(timeout=120)
    fx_optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    cut = fxpar_cut(program)
    torch_side = TorchPipeline(torch_model, cut, schedule_name, args.microbatches, batches[0][0])

    def fxpar_step(i: int) -> float:
        loss = runner.step(*runner.local_batch(*batches[i]))
        fx_optimizer.step()
        fx_optimizer.zero_grad()
        return loss

    def torch_step(i: int) -> torch.Tensor:
        return torch_side.step(*batches[i])

    runs = run_interleaved(
        [Side("torch", torch_step), Side("fxpar", fxpar_step)],
        warmup=args.warmup, steps=args.steps, block=args.block,
    )
    torch_losses = sum_over_ranks(runs["torch"].losses)
    fx_losses = runs["fxpar"].losses
    mismatch = first_mismatch(torch_losses, fx_losses, rel=LOSS_RELATIVE)
    boundary = (GLOBAL_BATCH // args.microbatches, SEQ, config.n_embd)
    ping = p2p_latency(boundary, compute_ms=3.0)
    bubble = fxpar_bubble(runner, fx_optimizer, program, batches, args.bubble_steps, args.warmup,
                          ping_ms=ping["sender computes"])
    torch_idle = torch_bubble(torch_side, batches, args.bubble_steps, args.warmup)
    torch_order = torch_side.order()
    result = {
        "model": name,
        "schedule": schedule_name,
        "microbatches": args.microbatches,
        "config": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")},
        "parameters": program.captured.parameter_count(),
        "cut": cut,
        "grid": str(program.schedule),
        # Where torch exposes its order: is it the same schedule as fxpar's, action for action?
        "same_order_as_torch": None if torch_order is None else
        torch_order == [[str(a) for a in row] for row in program.schedule.actions],
        **comparison(runs, "torch", torch_losses, fx_losses, mismatch),
        "boundary_shape": boundary,
        "p2p_latency_ms": ping,
        "bubble": bubble,
        "torch_bubble": torch_idle,
    }
    if mismatch is not None and runner.is_main:
        print(mismatch_message(f"{name} {schedule_name}", mismatch, ("torch", "fxpar"),
                               rel=LOSS_RELATIVE), flush=True)
    return result, runner


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # 2 ranks on 2 cores: one compute thread each
    results, runner = [], None
    for name in args.models:
        for schedule_name in args.schedules:
            result, runner = bench(name, schedule_name, args)
            results.append(result)
            if runner.is_main:
                print(progress_line(f"{name} {schedule_name}", result, "torch")
                      + f", losses match {result['losses_match']}"
                      + ("" if result["same_order_as_torch"] is None else
                         f", same order as torch's {result['same_order_as_torch']}"),
                      flush=True)
            if not result["losses_match"]:
                break
        if results and not results[-1]["losses_match"]:
            break
    is_main = runner.is_main
    runner.close()
    if is_main:
        report(results, args)
    return 0 if all(r["losses_match"] for r in results) else 1


def report(results: list[dict], args: argparse.Namespace) -> None:
    print()
    print(f"fxpar pp=2 vs torch.distributed.pipelining, gloo on CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread/rank, global batch {GLOBAL_BATCH}x{SEQ}, "
          f"{args.microbatches} microbatches, median of {args.steps} steps after {args.warmup} "
          f"warm-up (max over ranks), load average {os.getloadavg()[1]:.1f} (5 min)")
    header = ["model", "schedule", "cut", "torch ms/step [p10-p90]", "fxpar ms/step [p10-p90]",
              "fxpar/torch", "paired", "CPU ms torch/fxpar", "CPU ratio", "max loss rel diff"]
    rows = []
    for r in results:
        t, fx = r["torch"], r["fxpar"]
        rows.append([
            f"{r['model']} ({r['config']['n_embd']} wide)", r["schedule"], r["cut"],
            timing_cell(t),
            timing_cell(fx),
            f"{r['ratio']:.3f}", f"{r['paired_ratio']:.3f}",
            f"{r['torch_cpu']['median_ms']:.1f}/{r['fxpar_cpu']['median_ms']:.1f}",
            f"{r['cpu_ratio']:.3f}",
            f"{r['max_loss_relative_difference']:.1e}",
        ])
    print(format_table(header, rows))
    print("  paired: median over k of fxpar step k / torch step k; CPU: median main-thread CPU "
          "time per step (time.thread_time, mean over ranks), which leaves out waiting; "
          "CPU ratio: fxpar/torch of those")
    print()
    print(f"Measured bubble (fxpar, record_timeline, {args.bubble_steps} steps) against "
          "simulate(program.schedule, F, B, comm_cost) with each stage's median F and B")
    header = ["model", "schedule", "F ms s0/s1", "B (W) ms s0/s1", "step ms: measured/sim/replay",
              "measured idle", "simulated", "diff pp", "transfer ms: ping/observed",
              "simulated + ping", "diff pp", "simulated + observed", "replay", "receive wait",
              "torch idle (compute spans)"]
    rows = []
    for r in results:
        b, tb = r["bubble"], r["torch_bubble"]
        rows.append([
            r["model"], r["schedule"],
            "/".join(f"{v:.2f}" for v in b["forward_ms"]),
            "/".join(f"{v:.2f}" for v in b["backward_ms"])
            + ("" if not any(b["weight_ms"]) else
               " W " + "/".join(f"{v:.2f}" for v in b["weight_ms"])),
            f"{b['step_ms']:.1f}/{b['simulated_step_ms_none']:.1f}/{b['replay_step_ms']:.1f}",
            f"{100 * b['idle']:.1f}%", f"{100 * b['simulated_bubble_none']:.1f}%",
            f"{100 * (b['idle'] - b['simulated_bubble_none']):+.1f}",
            f"{b['ping_ms']:.2f}/{b['hop_ms']:.2f}",
            f"{100 * b['simulated_bubble_ping']:.1f}%",
            f"{100 * (b['idle'] - b['simulated_bubble_ping']):+.1f}",
            f"{100 * b['simulated_bubble_observed']:.1f}%",
            f"{100 * b['replay_bubble']:.1f}%",
            f"{100 * b['receive_wait_share']:.1f}%",
            f"{100 * tb['idle_compute']:.1f}%",
        ])
    print(format_table(header, rows))
    print("  T (step): earliest action start to latest action end over both ranks. idle: "
          "1 - busy / T, mean over ranks, median over steps (replay too); a rank idles only "
          "while it waits for a peer's data; busy = the runner.timeline() spans (from the end "
          "of an action's receives to the end of its isend posts) plus the executor's work "
          "between actions. F/B: median busy ms per action of each stage. simulated: "
          "simulate(schedule, F, B, comm_cost).bubble_fraction with no "
          "transfer cost, with the ping (one boundary tensor to a waiting receive, sender "
          "computing; measured just before) and with the median transfer latency observed "
          "in these steps (producer's end to the end of the consumer's wait, over waits "
          "> 50 us). replay: the simulator's rules with every action's own duration, no "
          "transfer cost. receive wait: share of T spent waiting for receives. torch idle: "
          "1 - its forward_one_chunk/backward_one_chunk spans / T (its work between chunks "
          "counts as idle there, so it is not comparable with fxpar's column). With unit "
          "costs (F = B = W) the bubble is "
          + ", ".join(sorted({f"{r['schedule']} {100 * r['bubble']['unit_cost_bubble']:.1f}%"
                              for r in results})))
    if args.json is not None:
        write_json(args.json, args, results)


if __name__ == "__main__":
    sys.exit(main())
