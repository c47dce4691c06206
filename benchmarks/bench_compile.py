"""Compile time: `fxpar.compile` against `torch.export.export` alone, six Hugging Face models.

    python benchmarks/bench_compile.py --repeats 5
    python benchmarks/bench_compile.py --models llama --plans tp=2 --profile

Target: compile at most 1.5x export. fxpar.compile is export plus fxpar's own work (unlifting
parameters, renaming symbols, the passes, the per-stage graphs of a pipeline), so the ratio is
what fxpar adds on top of the capture any torch.export user pays.

The models are tests/hf_models.py's small random-weight transformers (sdpa attention, batch
8, seq 16), wrapped as `forward(input_ids, labels) -> loss`. Each timed call gets a fresh model
(building it is not timed), in one process, and the sides take turns: for each repeat, every
side of every model runs once, so machine noise lands on all alike. A warm-up round on the
first model (the first export in a process pays for imports and caches) is not timed. Times
are the process's CPU time by default (`--clock wall` for wall-clock): on a shared machine a
wall-clock second includes waiting for a core. The tables give medians:

    export          torch.export.export(model, (ids, labels), strict=False)
    export dyn      the same with batch and seq dims Dim.AUTO, the call fxpar's capture makes
    dp=2, ...       fxpar.compile(model, plan, (ids, labels)), "fails" when it raises (the
                    error is printed below the tables); "/export" is over `export`, "/dyn"
                    over `export dyn`: what fxpar adds to its own capture

`--profile` runs cProfile over one compile per model and plan and prints where the time goes,
by file:function (own time and cumulative), fxpar's files first.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import fxpar  # noqa: E402
from harness import format_table  # noqa: E402
from hf_models import BUILDERS, build  # noqa: E402

PLANS = ("dp=2", "tp=2", "pp=2 mb=2")
TARGET = 1.5


def export_static(model, inputs):
    return torch.export.export(model, inputs, strict=False)


def export_dynamic(model, inputs):
    shapes = tuple({0: Dim.AUTO, 1: Dim.AUTO} for _ in inputs)
    return torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)


def sides(plans: list[str]) -> dict[str, callable]:
    timed = {"export": export_static, "export dyn": export_dynamic}
    for plan in plans:
        timed[plan] = lambda model, inputs, plan=plan: fxpar.compile(model, plan, inputs)
    return timed


def time_once(name: str, side, clock=time.process_time) -> float | str:
    """Seconds of one call on a fresh model, or the error's first line if it raised."""
    model, inputs = build(name)
    start = clock()
    try:
        side(model, inputs)
    except fxpar.FxparError as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return clock() - start


def profile(name: str, plan: str, top: int) -> None:
    """cProfile one compile; print the top functions by own time and by cumulative time."""
    model, inputs = build(name)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(fxpar.compile, model, plan, inputs)
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows, ours = [], []
    for (file, line, function), (_, _, own, cumulative, _) in stats.stats.items():
        in_repo = file.startswith(str(ROOT) + os.sep)
        where = os.path.relpath(file, ROOT) if in_repo else _short(file)
        rows.append((where, line, function, own, cumulative))
        if in_repo and not where.startswith("tests" + os.sep):
            ours.append(rows[-1])
    print(f"\n### {name} {plan}: {wall:.2f} s under cProfile")
    print("fxpar's functions by cumulative time (s):")
    for where, line, function, own, cumulative in sorted(ours, key=lambda r: -r[4])[:top]:
        print(f"  {cumulative:7.3f} cum {own:7.3f} own  {where}:{line}:{function}")
    print("all functions by own time (s):")
    for where, line, function, own, cumulative in sorted(rows, key=lambda r: -r[3])[:top]:
        print(f"  {own:7.3f} own {cumulative:7.3f} cum  {where}:{line}:{function}")


def _short(file: str) -> str:
    for marker in ("site-packages/", "lib/python"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(BUILDERS), choices=sorted(BUILDERS))
    parser.add_argument("--plans", nargs="+", default=list(PLANS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU time (steadier on a shared machine)")
    parser.add_argument("--profile", action="store_true", help="cProfile one compile per plan")
    parser.add_argument("--top", type=int, default=15, help="rows per profile table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    timed = sides(args.plans)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for side in timed.values():  # warm-up, untimed: imports, dispatch and decomposition caches
        time_once(args.models[0], side, clock)
    times = {(name, side): [] for name in args.models for side in timed}
    for _ in range(args.repeats):
        for name in args.models:
            for side, call in timed.items():
                times[name, side].append(time_once(name, call, clock))
    failures = {key: next(v for v in values if isinstance(v, str))
                for key, values in times.items() if any(isinstance(v, str) for v in values)}
    median = {key: statistics.median(values)
              for key, values in times.items() if key not in failures}

    seconds = [["model", "export", "export dyn", *args.plans]]
    ratios = [["model", *(f"{plan} /export" for plan in args.plans),
               *(f"{plan} /dyn" for plan in args.plans)]]
    worst = 0.0
    for name in args.models:
        base, dynamic = median[name, "export"], median[name, "export dyn"]
        seconds.append([name, f"{base:.2f}", f"{dynamic:.2f}"])
        over_export, over_dynamic = [], []
        for plan in args.plans:
            if (name, plan) in failures:
                seconds[-1].append("fails")
                over_export.append("-")
                over_dynamic.append("-")
                continue
            seconds[-1].append(f"{median[name, plan]:.2f}")
            worst = max(worst, median[name, plan] / base)
            over_export.append(f"{median[name, plan] / base:.2f}x")
            over_dynamic.append(f"{median[name, plan] / dynamic:.2f}x")
        ratios.append([name, *over_export, *over_dynamic])
    print(f"median {args.clock} seconds of {args.repeats}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(format_table(seconds[0], seconds[1:]))
    print("\ncompile over export (static), and over export dyn (the capture fxpar makes)")
    print(format_table(ratios[0], ratios[1:]))
    print(f"worst ratio {worst:.2f}x (target <= {TARGET}x)")
    for (name, side), message in failures.items():
        print(f"{name} {side} fails: {message[:300]}")
    if args.profile:
        for name in args.models:
            for plan in args.plans:
                if (name, plan) not in failures:
                    profile(name, plan, args.top)
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
