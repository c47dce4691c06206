"""Compiled mode on one GPU against torch.compile: step time, MFU, compile time and the peak.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu_compiled.py
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu_compiled.py --shapes tiny --device cpu

Issue #31's GPU numbers, for the shapes of `shared/measurements/h200-2026-12-04` (GPT-2 124M
and 350M at batch 16 x 1024, 774M at 8 x 1024), bf16, one rank. Per shape, the sides train the
same weights on the same batches, in alternating blocks (`harness.run_interleaved`), each step
ending in `torch.cuda.synchronize()`:

    torch.compile   the model compiled by Inductor, torch.autocast(bfloat16) around forward,
                    fp32 parameters and fused AdamW (what `mfu.py` measured: 35.5 ms at 124M)
    fxpar           "dp=1 precision=bf16-mixed compile=inductor": bf16 working weights, fp32
                    masters, the AdamW `runner.optimizer` makes (fused on CUDA)
    fxpar zero=3    the same with "zero=3", at the first shape only (ZeRO-3 at world 1)

Targets (#31): each fxpar side's step at most torch.compile's (at least its tokens/s); the
allocator's peak within 5% of `program.estimate()`'s (`memory["total"]`, read before the
torch side allocates); compiling at most 2x torch.compile's first step (each side's first
step, compile included; fxpar's also counts `fxpar.compile` and bind). Reported beside them:
MFU under the estimate's FLOP convention (`Estimate.mfu`) and measured / estimated step time
(#32's 0.9-1.1). The losses must agree to bf16's precision (`LOSS_RELATIVE`). The JSON has
one row per check for `gpu_summary.py`. `--device cpu --shapes tiny` is the script's own
smoke run (no peak, no targets).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config

import fxpar
from harness import (
    Side, bench_device, format_table, run_interleaved, side_by_side_arguments, synchronized, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

SHAPES = {  # name: (model, batch, sequence): the H200 measurements' part A
    "124M": (dict(n_layer=12, n_head=12, n_embd=768), 16, 1024),
    "350M": (dict(n_layer=24, n_head=16, n_embd=1024), 16, 1024),
    "774M": (dict(n_layer=36, n_head=20, n_embd=1280), 8, 1024),
    "tiny": (dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64), 2, 64),
}
OPTIMIZER = dict(lr=1e-4, weight_decay=0.1)
LOSS_RELATIVE = 2e-2  # bf16 roundings accumulated over the steps (bench_gpu_zero3.py)
PEAK_TARGET = 0.05
COMPILE_TARGET = 2.0


def parse_args():
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["124M", "350M", "774M"], choices=list(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hardware", default="h200", help="the estimate's profile")
    parser.set_defaults(steps=10, warmup=3)
    return parser.parse_args()


def fxpar_side(model, plan: str, example, batches, args, device):
    """Compile fxpar's side (on the CPU, where `model` and the `example` batch are), bind it,
    run its first step (its compile), and read its peak over one more step against the
    estimate: the allocator's peak less what other sides held on the device before it bound."""
    held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    started = time.perf_counter()
    program = fxpar.compile(model, plan, example_inputs=example)
    priced = time.perf_counter()
    estimate = program.estimate(args.hardware)  # not part of the compile time
    started += time.perf_counter() - priced
    runner = program.bind(timeout=900, device=device)
    optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)

    def step(i: int):
        loss = runner.step(*batches[i])
        optimizer.step()
        optimizer.zero_grad()
        return loss

    timed = synchronized(step, device)
    timed(0)  # the compile
    compile_seconds = time.perf_counter() - started
    timed(1)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        timed(2)
        peak = torch.cuda.max_memory_allocated(device) - held_before
    return runner, timed, {"estimate": estimate, "compile_seconds": compile_seconds, "peak": peak}


def torch_side(model, batches, device):
    """torch.compile's side: its step and its first step's seconds (the compile)."""
    model = copy.deepcopy(model).to(device)
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER, fused=device.type == "cuda")

    def step(i: int):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compiled(*batches[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach().float()

    timed = synchronized(step, device)
    started = time.perf_counter()
    timed(0)
    return timed, time.perf_counter() - started


def bench_shape(name: str, args, device) -> list[dict]:
    """Every side of one shape, timed side by side; one row per check (module doc)."""
    settings, batch, seq = SHAPES[name]
    config = GPTConfig(**settings)
    torch.manual_seed(0)
    model = GPT(config)
    count = 3 + args.warmup + args.steps + 1
    on_cpu = [tuple(torch.randint(0, config.vocab_size, (batch, seq)) for _ in range(2)) for _ in range(count)]
    batches = [tuple(t.to(device) for t in b) for b in on_cpu]
    plans = {"fxpar": "dp=1 precision=bf16-mixed compile=inductor"}
    if name == args.shapes[0]:
        plans["fxpar zero=3"] = "dp=1 zero=3 precision=bf16-mixed compile=inductor"
    runners, sides, readings = [], [], {}
    for side, plan in plans.items():
        runner, step, readings[side] = fxpar_side(copy.deepcopy(model), plan, on_cpu[0], batches, args, device)
        runners.append(runner)
        sides.append(Side(side, lambda i, step=step: step(i + 3)))  # steps 0-2 were its compile and peak
    torch_step, torch_compile = torch_side(model, batches, device)
    sides.insert(0, Side("torch.compile", lambda i: torch_step(i + 3)))
    runs = run_interleaved(sides, warmup=args.warmup, steps=args.steps, block=args.block)
    for runner in runners:
        runner.close()
    return _checks(name, runs, readings, torch_compile, device)


def _checks(name: str, runs, readings: dict, torch_compile: float, device) -> list[dict]:
    torch_run = runs["torch.compile"]
    rows = []

    def row(check, measured, target, met):
        rows.append({"check": f"{name} {check}", "measured": measured, "target": target, "met": met})

    for side, reading in readings.items():
        seconds, estimate = runs[side].timing.median, reading["estimate"]
        ratio = seconds / torch_run.timing.median
        row(f"{side} / torch.compile step", f"{ratio:.3f}", "<= 1.00", ratio <= 1.0)
        mfu = f"{estimate.mfu(seconds):.1%} ({estimate.mfu(torch_run.timing.median):.1%})"
        row(f"{side} MFU (torch.compile's)", mfu, "aim 50%", None)
        row(f"{side} measured / estimated step", f"{seconds / estimate.time['total']:.2f}", "0.9-1.1",
            0.9 <= seconds / estimate.time["total"] <= 1.1)
        compile_ratio = reading["compile_seconds"] / torch_compile
        row(f"{side} compile / torch.compile's", f"{compile_ratio:.2f}", f"<= {COMPILE_TARGET:g}",
            compile_ratio <= COMPILE_TARGET)
        loss = max(abs(float(a) - float(b)) / abs(float(b)) for a, b in zip(runs[side].losses, torch_run.losses))
        row(f"{side} losses against torch.compile's", f"{loss:.1e}", f"<= {LOSS_RELATIVE:g}", loss <= LOSS_RELATIVE)
        if reading["peak"] is not None:
            peak = reading["peak"] / estimate.memory["total"]
            row(f"{side} allocator peak / estimate", f"{peak:.3f}", f"1 +- {PEAK_TARGET:g}",
                abs(peak - 1) <= PEAK_TARGET)
    return rows


def main() -> int:
    args = parse_args()
    # Compile times as a fresh machine has them: no side reads what another compiled
    # (bench_inductor.py does the same).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    device = bench_device(args.device)
    rows = [r for name in args.shapes for r in bench_shape(name, args, device)]
    print(f"\nfxpar compile=inductor against torch.compile on {device}, torch {torch.__version__}, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(format_table(["check", "measured", "target", "met"],
                       [[r["check"], r["measured"], r["target"], {True: "yes", False: "NO", None: ""}[r["met"]]]
                        for r in rows]))
    if args.json:
        write_json(args.json, args, rows)
    smoke = device.type != "cuda"  # the CPU smoke run checks the script, not the targets
    return 0 if smoke or all(r["met"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
