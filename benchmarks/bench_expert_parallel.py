"""fxpar dp=N ep=N against torch DDP on the same Hugging Face mixture of experts.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_expert_parallel.py --steps 20 --warmup 3

The peer is the model as users train it today without expert parallelism: every rank holds
every expert, DistributedDataParallel all-reduces every gradient. fxpar's ranks each hold
half the experts (their weights, gradients and AdamW state) and send each routed row to the
rank of its expert and back by all-to-all (`--dispatch allgather`: gather each other's tokens
and reduce-scatter the results back; `passes.expert_parallel`), while the dense weights are
data-parallel as DDP's. Both sides start from one seeded Mixtral (transformers 5, grouped
experts), train on the same batches with AdamW and buckets of the same size, and their
global-batch losses must agree to 1e-5 relative at every step.

Reported per model: the step time of each side and their ratio (median of the timed steps,
alternating blocks: `harness.run_interleaved`), the bytes the expert collectives moved in the
last step, summed over the ranks (`runner.comm_log`), against the compiler's prediction for them
(`program.collectives`: the all-gather's shapes are static; the all-to-all's rows are the
router's, predicted at uniform routing, and over the ranks every row sent is received, so the
sums agree), and the expert state each rank holds against DDP's.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel

import fxpar
from harness import (
    OPTIMIZER, Side, comparison, first_mismatch, format_table, mean_over_ranks, mismatch_message, module_step,
    run_interleaved, run_models, runner_step, side_by_side_arguments, timing_cell, write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import LossOf  # noqa: E402

LOSS_RELATIVE = 1e-5
BATCH, VOCAB = 8, 1024
# name -> (hidden, expert intermediate, experts, sequence)
MODELS = {"small": (128, 256, 8, 128), "medium": (256, 512, 8, 256)}


def parse_args() -> argparse.Namespace:
    parser = side_by_side_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket MiB, both sides")
    parser.add_argument("--ep", type=int, default=None,
                        help="fxpar's ep (default: the world size; 1 runs fxpar's own dp with the experts replicated)")
    parser.add_argument("--dispatch", default="alltoall", choices=["alltoall", "allgather"],
                        help="how fxpar's ep moves tokens to their experts")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def mixtral(name: str, seed: int) -> torch.nn.Module:
    hidden, intermediate, experts, seq = MODELS[name]
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LossOf(transformers.MixtralForCausalLM(config).train())


def expert_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if ".experts." in n)


def bench_model(name: str, args: argparse.Namespace):
    """One model under both sides; the result row and its runner (left open)."""
    world = int(os.environ["WORLD_SIZE"])
    seq = MODELS[name][3]
    model = mixtral(name, args.seed)
    ddp_model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=generator)
        batches.append((ids, ids.clone()))
    ep = world if args.ep is None else args.ep
    experts = f" ep={ep} dispatch={args.dispatch}" if ep > 1 else ""
    plan = f"dp={world}{experts} bucket_mb={args.bucket_mb:g}"
    program = fxpar.compile(model, plan, example_inputs=batches[0])
    runner = program.bind(timeout=120)
    local = [runner.local_batch(*b) for b in batches]
    ddp = DistributedDataParallel(ddp_model, bucket_cap_mb=args.bucket_mb)
    runs = run_interleaved(
        [Side("ddp", module_step(ddp, torch.optim.AdamW(ddp.parameters(), **OPTIMIZER), local)),
         Side("fxpar", runner_step(runner, runner.optimizer(torch.optim.AdamW, **OPTIMIZER), local))],
        warmup=args.warmup, steps=args.steps, block=args.block,
    )
    ddp_losses, fx_losses = mean_over_ranks(runs["ddp"].losses), runs["fxpar"].losses
    mismatch = first_mismatch(ddp_losses, fx_losses, rel=LOSS_RELATIVE)
    if mismatch is not None and runner.is_main:
        print(mismatch_message(name, mismatch, ("ddp", "fxpar"), rel=LOSS_RELATIVE), flush=True)
    # the last step's expert collectives (`comm_log`), against the compiler's list of them
    predicted = [c for c in program.collectives(runner.rank, backend=runner.backend) if c.tag.startswith("ep ")]
    moved = [c for c in runner.comm_log() if c.tag.startswith("ep ")]
    ep_bytes = torch.tensor([sum(c.payload_bytes for c in calls) for calls in (predicted, moved)])
    torch.distributed.all_reduce(ep_bytes)  # over the ranks (module doc)
    result = {"model": name, "plan": plan, "seq": seq, "batch": BATCH, "parameters": program.captured.parameter_count(),
              "ep_bytes_predicted": int(ep_bytes[0]), "ep_bytes_moved": int(ep_bytes[1]),
              "expert_bytes_ddp": expert_bytes(ddp_model), "expert_bytes_fxpar": expert_bytes(runner.modules[0]),
              **comparison(runs, "ddp", ddp_losses, fx_losses, mismatch)}
    return result, runner


def report(results: list[dict], args: argparse.Namespace) -> None:
    header = ["model", "params", "fxpar plan", "DDP ms [p10-p90]", "fxpar ms [p10-p90]", "fxpar/DDP", "paired",
              "ep bytes moved/predicted", "expert bytes fxpar/DDP", "losses match"]
    rows = [[r["model"], f"{r['parameters']:,}", r["plan"], timing_cell(r["ddp"]), timing_cell(r["fxpar"]), f"{r['ratio']:.3f}",
             f"{r['paired_ratio']:.3f}",
             f"{r['ep_bytes_moved']:,} / {r['ep_bytes_predicted']:,}" if r["ep_bytes_predicted"] else "-",
             f"{r['expert_bytes_fxpar'] / r['expert_bytes_ddp']:.3f}",
             f"yes ({r['max_loss_relative_difference']:.1e})" if r["losses_match"] else "NO"] for r in results]
    print(format_table(header, rows))
    if args.json:
        write_json(args.json, args, results)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # one compute thread a rank, one rank a core
    return run_models(args.models, bench_model, args, native="ddp", report=report)


if __name__ == "__main__":
    sys.exit(main())
