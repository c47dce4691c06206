"""fxpar cp=N against the same model on one device, at growing sequence lengths.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_context_parallel.py --steps 20 --warmup 3

The peer the issue names, torch's `context_parallel` (torch.distributed.tensor.experimental),
has no CPU path: its SDPA dispatch has no sharding strategy for
`aten._scaled_dot_product_flash_attention_for_cpu` (torch 2.13, NotImplementedError), so on
this machine cp is measured against what it divides: one device training the same model on
the same whole batch. Every rank runs that one-device step on its own core (the native side,
no communication), then the cp ranks run fxpar's step together; the ratio's ideal is 1 / cp,
and what it exceeds that by is the keys' and values' gathers, their reduce-scatters, the sums
of the gradients and the loss over cp, and the work of the whole values (positions, masks)
every rank computes. The example Llama (rotary positions, causal SDPA), fp32, AdamW; both
sides start from one seeded model and train on the same batches, and their losses must agree
to 1e-5 relative at every step.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

import fxpar
from harness import (
    OPTIMIZER, Side, comparison, first_mismatch, format_table, mismatch_message, module_step,
    run_interleaved, run_models, runner_step, side_by_side_arguments, timing_cell, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import Llama, LlamaConfig  # noqa: E402

LOSS_RELATIVE = 1e-5
BATCH = 2


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["512", "1024", "2048"],
                        help="sequence lengths of the example Llama (2 layers, width 128, 4 heads)")
    parser.add_argument("--plan", default="", help="plan fields beside cp=WORLD_SIZE (checkpoint=selective)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def bench_model(name: str, args: argparse.Namespace) -> tuple[dict, object]:
    """One sequence length under both sides; the result row and its runner (left open)."""
    seq, world = int(name), int(os.environ["WORLD_SIZE"])
    config = LlamaConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=4, n_embd=128,
                         intermediate_size=352, max_seq_len=seq)
    torch.manual_seed(args.seed)
    model = Llama(config)
    one_device = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = [tuple(torch.randint(0, 256, (BATCH, seq), generator=generator) for _ in range(2))
               for _ in range(args.warmup + args.steps)]
    plan = f"cp={world} {args.plan}".strip()
    program = fxpar.compile(model, plan, example_inputs=batches[0])
    runner = program.bind(timeout=120)
    runs = run_interleaved(
        [Side("one device", module_step(one_device, torch.optim.AdamW(one_device.parameters(), **OPTIMIZER), batches)),
         Side("fxpar", runner_step(runner, runner.optimizer(torch.optim.AdamW, **OPTIMIZER), batches))],
        warmup=args.warmup, steps=args.steps, block=args.block,
    )
    native, fx = runs["one device"].losses, runs["fxpar"].losses
    mismatch = first_mismatch(native, fx, rel=LOSS_RELATIVE)
    if mismatch is not None and runner.is_main:
        print(mismatch_message(f"seq {seq}", mismatch, ("one device", "fxpar"), rel=LOSS_RELATIVE), flush=True)
    estimate = program.estimate("cpu")
    result = {"model": name, "plan": plan, "seq": seq, "batch": BATCH,
              "predicted_activations": estimate.memory["activations"],
              "comm_bytes_per_step": sum(c.payload_bytes for c in program.collectives(runner.rank)),
              **comparison(runs, "one device", native, fx, mismatch)}
    return result, runner


def report(results: list[dict], args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    header = ["seq", "plan", "one device ms [p10-p90]", "fxpar ms [p10-p90]", "fxpar / one device",
              "ideal", "paired", "CPU ratio", "losses match"]
    rows = [[r["seq"], r["plan"], timing_cell(r["one device"]), timing_cell(r["fxpar"]), f"{r['ratio']:.3f}",
             f"{1 / world:.3f}", f"{r['paired_ratio']:.3f}", f"{r['cpu_ratio']:.3f}",
             f"yes ({r['max_loss_relative_difference']:.1e})" if r["losses_match"] else "NO"] for r in results]
    print(format_table(header, rows))
    if args.json:
        write_json(args.json, args, results)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # one compute thread a rank, one rank a core
    return run_models(args.models, bench_model, args, native="one device", report=report)


if __name__ == "__main__":
    sys.exit(main())
