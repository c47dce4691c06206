"""ZeRO-3 on one GPU against eager bf16 training and FSDP2: step time and the allocator's peak.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu_zero3.py
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu_zero3.py --model tiny --batch 4 --seq 64 --device cpu

The CUDA check of ZeRO-3 (docs/design.md's FSDP2 baseline: 1.48x eager at world 1): GPT-2 124M
(examples/gpt.py's defaults) in bf16 mixed precision, batch 16, sequence 1024, one rank on
NCCL. Three sides train the same weights on the same batches, timed in alternating blocks
(`harness.run_interleaved`), each step ending in `torch.cuda.synchronize()`:

    eager   torch.autocast(bfloat16) around forward, fp32 parameters and AdamW
    fsdp2   fully_shard per block and on the root, MixedPrecisionPolicy(bf16 params, fp32 reduce)
    fxpar   "dp=1 zero=3 precision=bf16-mixed": bf16 working weights, fp32 masters and AdamW

Targets: fxpar/eager <= 1.10, and the allocator's peak over one fxpar step
(`runner.memory_stats()["peak"]`, `torch.cuda.max_memory_allocated` since a reset) within 5%
of `program.estimate()`'s predicted peak (`memory["total"]`). The peak is read before the
other sides exist, so it holds fxpar's tensors alone. Model-state bytes are compared with
the estimate too (expected exact).

The sides round differently (autocast keeps layer norm, softmax and the loss in fp32; fxpar's
bf16-mixed runs the whole graph in bf16 and reports the loss in fp32), so their losses agree
to bf16's precision, not bit for bit: the script exits 1 if any step's loss differs from
eager's by more than `LOSS_RELATIVE` (a few bf16 roundings, 2^-8 each, accumulated over the
steps), or if a target is missed. `--device cpu` (gloo, no peak) is the script's own smoke run.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fxpar
from harness import (
    GPT_SIZES, Side, bench_device, format_table, paired_ratio, run_interleaved, side_by_side_arguments,
    synchronized, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

MODELS = {"gpt2": GPTConfig(), **GPT_SIZES}  # gpt2: GPT-2 124M (n_layer 12, n_embd 768)
OPTIMIZER = dict(lr=1e-4, weight_decay=0.1)
LOSS_RELATIVE = 2e-2
TIME_TARGET = 1.10  # fxpar / eager
PEAK_TARGET = 0.05  # |measured - predicted| / predicted


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hardware", default="h200", help="the estimate's profile (peak memory does not depend on it)")
    parser.set_defaults(steps=20, warmup=3)
    return parser.parse_args()


def eager_step(model, optimizer, batches, device: torch.device):
    def step(i: int) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(*batches[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach().float()
    return step


def fxpar_side(model, example, batches, args, device: torch.device):
    """Compile (on the CPU, where `model` and the `example` batch are) and bind fxpar's side;
    measure its peak and model state against the estimate before any other side allocates on
    the device."""
    program = fxpar.compile(model, "dp=1 zero=3 precision=bf16-mixed", example_inputs=example)
    predicted = program.estimate(args.hardware).memory
    runner = program.bind(timeout=600, device=device)
    optimizer = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    for i in range(2):  # the optimizer's state exists after its first step
        runner.step(*batches[i])
        optimizer.step()
        optimizer.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    runner.step(*batches[2])
    optimizer.step()
    measured = runner.memory_stats()  # before zero_grad: gradients still held, as predicted
    optimizer.zero_grad()
    memory = {key: {"predicted": int(predicted[key]), "measured": measured[key]}
              for key in ("params", "grads", "optimizer")}
    memory["peak"] = {"predicted": int(predicted["total"]), "measured": measured["peak"]}

    def step(i: int) -> float:
        loss = runner.step(*batches[i])
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return runner, step, memory


def main() -> int:
    args = parse_args()
    device = bench_device(args.device)
    config = MODELS[args.model]
    if args.seq > config.block_size:
        raise SystemExit(f"--seq {args.seq} exceeds the model's block_size {config.block_size}")
    torch.manual_seed(0)
    model = GPT(config)
    count = 3 + args.warmup + args.steps + 1
    batches = [tuple(torch.randint(0, config.vocab_size, (args.batch, args.seq)) for _ in range(2))
               for _ in range(count)]
    on_device = [tuple(t.to(device) for t in b) for b in batches]

    # Copied before fxpar binds the model's own tensors, moved to the device after its peak.
    eager_model, fsdp_model = copy.deepcopy(model), copy.deepcopy(model)
    runner, fx_step, memory = fxpar_side(model, batches[0], on_device, args, device)
    eager_model.to(device)
    fsdp_model.to(device)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), **OPTIMIZER)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in fsdp_model.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(fsdp_model, mesh=mesh, mp_policy=policy)
    fsdp_optimizer = torch.optim.AdamW(fsdp_model.parameters(), **OPTIMIZER)
    # Each side starts at step 3 of the batches (fxpar's memory reading ran 0-2 on its own).
    sides = [Side("eager", synchronized(eager_step(eager_model, eager_optimizer, on_device[3:], device), device)),
             Side("fsdp2", synchronized(eager_step(fsdp_model, fsdp_optimizer, on_device[3:], device), device)),
             Side("fxpar", synchronized(lambda i: fx_step(i + 3), device))]
    runs = run_interleaved(sides, warmup=args.warmup, steps=args.steps, block=args.block)
    runner.close()
    return report(args, runs, memory, device)


def report(args, runs, memory, device) -> int:
    eager = runs["eager"]
    losses = {name: [float(x) for x in run.losses] for name, run in runs.items()}
    loss_difference = {name: max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["eager"]))
                       for name in ("fsdp2", "fxpar")}
    ratio = {name: runs[name].timing.median / eager.timing.median for name in ("fsdp2", "fxpar")}
    print(f"\nZeRO-3 at world 1 against eager, {args.model} bf16-mixed, batch {args.batch}x{args.seq}, "
          f"{device}, torch {torch.__version__}, median of {args.steps} steps after {args.warmup} warm-up")
    rows = [[name, f"{run.timing.median * 1e3:.1f} [{run.timing.p10 * 1e3:.1f}-{run.timing.p90 * 1e3:.1f}]",
             "1.000" if name == "eager" else f"{ratio[name]:.3f}",
             "" if name == "eager" else f"{paired_ratio(eager.timing, run.timing):.3f}",
             "" if name == "eager" else f"{loss_difference[name]:.1e}"]
            for name, run in runs.items()]
    print(format_table(["side", "ms [p10-p90]", "/ eager", "paired", "max loss rel diff"], rows))
    print(format_table(["fxpar memory", "predicted bytes", "measured bytes", "error %"],
                       [[key, f"{v['predicted']:,}", "n/a" if v["measured"] is None else f"{v['measured']:,}",
                         "" if v["measured"] is None else f"{(v['predicted'] - v['measured']) / v['measured'] * 100:+.2f}"]
                        for key, v in memory.items()]))
    failures = []
    if ratio["fxpar"] > TIME_TARGET:
        failures.append(f"fxpar/eager {ratio['fxpar']:.3f} > {TIME_TARGET}")
    peak = memory["peak"]
    if peak["measured"] is not None and abs(peak["predicted"] - peak["measured"]) > PEAK_TARGET * peak["predicted"]:
        failures.append(f"peak {peak['measured']:,} B is not within {PEAK_TARGET:.0%} of the estimate's {peak['predicted']:,} B")
    failures += [f"{name}'s losses differ from eager's by {d:.1e} relative" for name, d in loss_difference.items()
                 if d > LOSS_RELATIVE]
    print("\n".join(["targets met"] if not failures else ["MISSED: " + f for f in failures]))
    if args.json:
        write_json(args.json, args, [{"ratio": ratio, "memory": memory, "loss_difference": loss_difference,
                                      **{name: run.timing.to_dict() for name, run in runs.items()}}])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
