"""How well `plan="auto"` ranks plans: every plan the planner finds feasible, run for real.

    python benchmarks/bench_planner.py --models small --world 4          # ~10 minutes on 2 cores
    python benchmarks/bench_planner.py --models small medium --json out.json

For each GPT size (`harness.GPT_SIZES`, global batch `harness.GLOBAL_BATCH` x `harness.SEQ`):

1. the `cpu` profile is measured here, once, at one thread (as bench_cost_model does), and
   `fxpar.plan_auto` searches the plans of `--world` ranks with it (memory per device
   `--memory`, default this machine's share);
2. every plan that fits (or `--max-plans` of them, spread evenly over the ranking) runs in one
   torchrun job of `--world` CPU ranks: each rank compiles the plan, binds, trains `--warmup`
   steps and then `--steps` timed ones (forward, backward, optimizer step; the wall time of
   each is the max over ranks, `cost_model_harness.timed_steps`), and measures its peak as
   bench_cost_model does against `memory.total`: the model state `runner.memory_stats()`
   counts before a step plus the allocation peak of its forward and backward
   (`cost_model_harness.allocation_peak`), the max over ranks;
3. the table gives, per plan, predicted and measured step time (median) and peak, and below it
   what the issue holds the planner to: Kendall's tau between the predicted and the measured
   order, the top-1 regret (the measured time of the planner's choice over the best measured),
   the mean absolute step-time error, and every plan whose measured peak exceeds its predicted
   peak by more than 3%.

Plans run one after another in the same processes, so a slow machine slows all alike; the
measured profile is the one the search used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from harness import GPT_SIZES, OPTIMIZER, format_table, global_batches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["small"], choices=list(GPT_SIZES))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--memory", default=None, help="memory per device (default this machine's share)")
    parser.add_argument("--max-plans", type=int, default=None, help="run at most this many of the plans that fit")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(Path(args.worker[0]), Path(args.worker[1]))
    results = [bench_model(name, args) for name in args.models]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def bench_model(name: str, args) -> dict:
    import fxpar
    from fxpar.cost.profiles import hardware_profile

    torch.set_num_threads(1)
    hardware_profile("cpu")  # measured now, on a quiet machine, and cached for the search
    model, batch = _model(name)
    started = time.perf_counter()
    search = fxpar.plan_auto(model, batch, world_size=args.world, hardware="cpu", memory_per_device=args.memory)
    searched = time.perf_counter() - started
    ranked = list(search.ranked)
    if args.max_plans and len(ranked) > args.max_plans:
        ranked = [ranked[round(i * (len(ranked) - 1) / (args.max_plans - 1))] for i in range(args.max_plans)]
    with tempfile.TemporaryDirectory() as folder:
        job, out = Path(folder) / "job.json", Path(folder) / "out.json"
        job.write_text(json.dumps({"model": name, "plans": [str(s.plan) for s in ranked],
                                   "steps": args.steps, "warmup": args.warmup}))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={args.world}", __file__, "--worker", str(job), str(out)], check=True)
        measured = json.loads(out.read_text())
    rows = [{"plan": str(s.plan), "predicted_s": s.seconds, "predicted_peak": s.peak_bytes, **measured[str(s.plan)]}
            for s in ranked]
    summary = _summary(rows, chosen=str(search.plan))
    _print(name, search, searched, rows, summary)
    return {"model": name, "search_seconds": searched, "chosen": str(search.plan), "rows": rows, **summary}


def _model(name: str):
    from gpt import GPT

    torch.manual_seed(0)
    return GPT(GPT_SIZES[name]), global_batches(GPT_SIZES[name].vocab_size, 1, seed=0)[0]


def run_worker(job_path: Path, out: Path) -> None:
    """One torchrun rank: each plan of the job compiled, bound, trained and measured."""
    import torch.distributed as dist

    import fxpar
    from cost_model_harness import allocation_peak, timed_steps
    from harness import reduce_over_ranks

    job = json.loads(job_path.read_text())
    torch.set_num_threads(1)
    results = {}
    for plan in job["plans"]:
        model, batch = _model(job["model"])
        runner = fxpar.compile(model, plan, example_inputs=batch).bind(timeout=120)
        optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
        local = runner.local_batch(*batch)

        def step():
            runner.step(*local)
            optimizer.step()
            optimizer.zero_grad()

        wall, _ = timed_steps([step], warmup=job["warmup"], steps=job["steps"], world_size=dist.get_world_size())
        state = runner.memory_stats()
        held = sum(state[k] for k in ("params", "grads", "optimizer"))
        peak = reduce_over_ranks([held + allocation_peak(lambda: runner.step(*local))["peak"]], "max")[0]
        optimizer.zero_grad()
        results[plan] = {"measured_s": statistics.median(w[0] for w in wall), "measured_peak": peak}
        runner.close()
    if os.environ["RANK"] == "0":  # (each runner's close took the process group down)
        out.write_text(json.dumps(results))


def _summary(rows: list[dict], *, chosen: str) -> dict:
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    best = min(measured)
    over = [r["plan"] for r in rows if r["measured_peak"] > 1.03 * r["predicted_peak"]]
    return {
        "plans": len(rows),
        "kendall_tau": kendall_tau(predicted, measured),
        "top1_regret": next(r["measured_s"] for r in rows if r["plan"] == chosen) / best - 1,
        "mean_abs_time_error": statistics.mean(abs(p - m) / m for p, m in zip(predicted, measured)),
        "peak_over_predicted_3pct": over,
    }


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two rankings (ties in either count for neither side)."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            x, y = a[i] - a[j], b[i] - b[j]
            if x == 0 and y == 0:
                continue
            if x == 0:
                ties_a += 1
            elif y == 0:
                ties_b += 1
            elif (x > 0) == (y > 0):
                concordant += 1
            else:
                discordant += 1
    pairs = ((concordant + discordant + ties_a) * (concordant + discordant + ties_b)) ** 0.5
    return (concordant - discordant) / pairs if pairs else 1.0


def _print(name: str, search, searched: float, rows: list[dict], summary: dict) -> None:
    print(f"\n{name}: {len(search.ranked)} plans fit of {len(search.ranked) + len(search.rejected)} "
          f"(search {searched:.1f} s), chosen '{search.plan}'; load {os.getloadavg()[0]:.1f}")
    table = [[r["plan"], f"{1e3 * r['predicted_s']:.2f}", f"{1e3 * r['measured_s']:.2f}",
              f"{r['predicted_s'] / r['measured_s']:.2f}", f"{r['predicted_peak'] / 2**20:.1f}",
              f"{r['measured_peak'] / 2**20:.1f}"] for r in rows]
    print(format_table(["plan", "pred ms", "meas ms", "pred/meas", "pred MiB", "meas MiB"], table))
    print(f"Kendall tau {summary['kendall_tau']:.3f} (target >= 0.9); top-1 regret "
          f"{100 * summary['top1_regret']:.1f}% (<= 3%); mean |time error| "
          f"{100 * summary['mean_abs_time_error']:.1f}% (<= 10%); peaks over predicted + 3%: "
          f"{summary['peak_over_predicted_3pct'] or 'none'}")


if __name__ == "__main__":
    main()
