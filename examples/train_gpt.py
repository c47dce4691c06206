"""Train a small byte-level GPT on the Python standard library with fxpar, under torchrun.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --plan dp=4 --steps 200
    python examples/train_gpt.py --steps 50          # no torchrun: one process, dp=1

    # checkpoints every 50 steps; a crash restarts the job from the newest complete one
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_gpt.py \
        --plan "dp=2 zero=1" --steps 200 --save-every 50 --resume auto --checkpoint-dir ckpt

The script is the whole user-side story of fxpar, top to bottom:

1. build an ordinary single-device model (`gpt.py`), with the same seed on every rank so
   every rank starts from the same weights;
2. `fxpar.compile(model, plan, example_inputs=...)` captures it and plans the job; this is
   pure computation, identical on every rank, and needs no process group;
3. `program.bind()` joins the torchrun job: process groups, this rank's shards, its device;
4. each step every rank draws the *same global batch* from an identically seeded generator
   and keeps its own data-parallel slice (`runner.local_batch`); `runner.step` runs forward
   and backward and returns the global-batch mean loss, the same number on every rank;
5. every `--save-every` steps `runner.save` writes a checkpoint (each rank its own shards,
   with the optimizer state, the step and the data generator's position); `--resume auto`
   loads the newest complete one, under this plan or another, so a job that torchrun restarts
   after a crash goes on exactly where its last checkpoint left it.

The data is the standard library's own source, one token per byte (`text_data.py`), so
there is nothing to download and the run is reproducible on any machine with the same Python.
"""

from __future__ import annotations

import argparse
import base64
import math
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example modules

import fxpar  # noqa: E402
from fxpar.runtime.checkpoint.save_load import latest_checkpoint  # noqa: E402
from fxpar.schedule.gantt import gantt  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from text_data import VOCAB_SIZE, ByteDataset, load_stdlib_text  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    world_size = os.environ.get("WORLD_SIZE", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=f"dp={world_size}",
                        help='fxpar plan, e.g. "dp=2 tp=2" (default: dp=WORLD_SIZE)')
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    parser.add_argument("--seq", type=int, default=128, help="sequence length, in bytes")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up length")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                        help="muon: torch.optim.Muon for the hidden matrices, AdamW for the rest "
                             "(Muon reads whole matrices: plans without tp or ZeRO)")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon's peak learning rate")
    parser.add_argument("--grad-clip", type=float, default=1.0,
                        help="clip the gradients to this global norm before each step (0: no clipping)")
    parser.add_argument("--seed", type=int, default=1337,
                        help="model init, data order and dropout's masks (rank 0's seed is the job's)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout probability; add rng=exact to the plan for one device's masks")
    parser.add_argument("--save", type=Path, default=None,
                        help="write the consolidated state dict here (rank 0) at the end")
    parser.add_argument("--save-full", type=Path, default=None,
                        help="write the whole model as one safetensors file here at the end "
                             "(and the optimizer state beside it, NAME.optimizer.safetensors; "
                             "with --optimizer muon NAME.optimizer.0/1.safetensors)")
    parser.add_argument("--timeline", action="store_true",
                        help="with a pipeline: print the last step's Gantt chart (rank 0)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                        help="where --save-every writes step-NNNNNNNN checkpoint folders")
    parser.add_argument("--save-every", type=int, default=0,
                        help="write a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", default="none",
                        help='"auto": the newest complete checkpoint in --checkpoint-dir (none: '
                             'start fresh); a checkpoint folder; or "none"')
    # The resume test's crash: rank R SIGKILLs itself as step S starts, on torchrun's first
    # attempt only (TORCHELASTIC_RESTART_COUNT 0), so the restarted job runs through.
    parser.add_argument("--kill-rank-at", default=None, metavar="R:S", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_optimizers(args: argparse.Namespace, runner, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW with nanoGPT's groups (matrices decay, biases and LayerNorm weights do not), or with
    `--optimizer muon` torch.optim.Muon for the hidden matrices and that AdamW for the
    embeddings (the head is tied to one) and vectors, as Muon's documentation advises. Each
    group's `initial_lr` is its peak rate, which the schedule scales."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    hidden = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
    decayed = [p for p in model.parameters() if p.dim() >= 2 and (args.optimizer == "adamw" or id(p) in embeddings)]
    groups = [{"params": decayed}, {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizers = [runner.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                   param_groups=groups)]
    if args.optimizer == "muon":
        optimizers.insert(0, runner.optimizer(torch.optim.Muon, lr=args.muon_lr, weight_decay=args.weight_decay,
                                              param_groups=[{"params": hidden}]))
    for group in (g for o in optimizers for g in o.param_groups):
        group["initial_lr"] = group["lr"]
    return optimizers


def generator_position(generator: torch.Generator) -> str:
    """The data generator's state as JSON-able text (a checkpoint's `extra`)."""
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode()


def set_generator_position(generator: torch.Generator, position: str) -> None:
    state = torch.frombuffer(bytearray(base64.b64decode(position)), dtype=torch.uint8)
    generator.set_state(state)


def resume(args: argparse.Namespace, runner, opt, generator: torch.Generator) -> int:
    """Load `--resume`'s checkpoint (the model, the optimizer, the data position); the step
    to go on from (0 when there is none to load)."""
    if args.resume == "none":
        return 0
    path = latest_checkpoint(args.checkpoint_dir) if args.resume == "auto" else Path(args.resume)
    if path is None:
        if runner.is_main:
            print(f"--resume auto: no checkpoint in {args.checkpoint_dir}; starting fresh", flush=True)
        return 0
    resumed = runner.load(path, optimizer=opt)
    set_generator_position(generator, resumed.extra["data_generator"])
    if runner.is_main:
        print(f"resumed from {path} at step {resumed.step} (saved under plan '{resumed.plan}')", flush=True)
    return resumed.step


def crash_if_asked(args: argparse.Namespace, rank: int, step: int) -> None:
    if args.kill_rank_at is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    kill_rank, kill_step = (int(x) for x in args.kill_rank_at.split(":"))
    if rank == kill_rank and step == kill_step:
        print(f"rank {rank}: killing myself at step {step} (--kill-rank-at)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def learning_rate(step: int, *, max_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to `max_lr`, then cosine decay to `max_lr / 10` at `total_steps`.

    The schedule of nanoGPT's `get_lr`; the floor of a tenth of the peak follows the
    Chinchilla paper (Hoffmann et al. 2022, Sec. 3).
    """
    min_lr = max_lr / 10
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (max_lr - min_lr)


def ensure_distributed_env() -> None:
    """Make a plain `python train_gpt.py` look like a one-process torchrun job.

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address; without it we
    set them ourselves, with a port the OS reports free (bind to port 0, read it back).
    """
    if "RANK" in os.environ:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    print(f"no torchrun environment: running as one process (world size 1, port {port})",
          flush=True)


def format_comm_stats(stats: dict[str, dict[str, int]]) -> str:
    """`{"all_reduce": {"count": 30, "bytes": 1.2e7}}` -> `"all_reduce 30x 12.0 MB"`."""
    if not stats:
        return "none"
    return ", ".join(f"{kind} {s['count']}x {s['bytes'] / 1e6:.1f} MB"
                     for kind, s in sorted(stats.items()))


def print_pipeline_timeline(runner, program) -> None:
    """Rank 0 prints the last step of the first pipeline (dp 0, tp 0) as a Gantt chart."""
    if program.stages is None:
        if runner.is_main:
            print("--timeline: this plan has no pipeline (pp=1); nothing to show", flush=True)
        return
    timelines = [None] * runner.world_size
    torch.distributed.all_gather_object(timelines, runner.timeline())  # every rank takes part
    if runner.is_main:
        first_pipeline = [program.mesh.rank_of(dp=0, pp=i, tp=0) for i in range(program.mesh.pp)]
        print(f"last step, schedule {program.schedule.name}:")
        print(gantt([timelines[r] for r in first_pipeline]), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ensure_distributed_env()
    try:
        plan = fxpar.Plan.parse(args.plan)
    except fxpar.PlanError as error:
        sys.exit(f"--plan {args.plan!r}: {error}")

    # Identical on every rank: same weights, same data, same example batch.
    torch.manual_seed(args.seed)
    config = GPTConfig(block_size=args.seq, vocab_size=VOCAB_SIZE, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, bias=True)
    model = GPT(config)
    dataset = ByteDataset(load_stdlib_text())
    generator = torch.Generator().manual_seed(args.seed)
    example = dataset.get_batch("train", args.batch, args.seq,
                                torch.Generator().manual_seed(args.seed))
    try:
        program = fxpar.compile(model, plan, example_inputs=example)
    except fxpar.PlanError as error:
        sys.exit(f"plan {args.plan!r} does not fit this model and batch: {error}")

    runner = program.bind()
    try:
        if runner.device.type == "cpu":  # share the cores instead of oversubscribing them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // runner.world_size))
        try:
            optimizers = make_optimizers(args, runner, model)
        except fxpar.PlanError as error:
            sys.exit(f"--optimizer {args.optimizer} under plan {args.plan!r}: {error}")
        opt = optimizers[0] if len(optimizers) == 1 else optimizers  # what a checkpoint holds
        if runner.is_main:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"plan {args.plan!r} on {runner.world_size} rank(s), {runner.device}; "
                  f"{n_params / 1e6:.2f}M parameters; {len(dataset.train):,} training bytes; "
                  f"global batch {args.batch} x {args.seq} tokens", flush=True)

        start = resume(args, runner, opt, generator)
        tokens_per_step = args.batch * args.seq  # global, summed over data-parallel ranks
        losses: list[float] = []
        step_seconds: list[float] = []
        smooth_loss: float | None = None
        bar = tqdm(range(start, args.steps), disable=not runner.is_main, desc="train", unit="step")
        for step in bar:
            crash_if_asked(args, runner.rank, step)
            scale = learning_rate(step, max_lr=1.0, warmup_steps=args.warmup_steps, total_steps=args.steps)
            for group in (g for o in optimizers for g in o.param_groups):
                group["lr"] = group["initial_lr"] * scale
            x, y = dataset.get_batch("train", args.batch, args.seq, generator)  # (B, T) each
            xs, ys = runner.local_batch(x, y)  # (B / dp, T) each: this rank's rows

            runner.record_timeline = args.timeline and step == args.steps - 1
            t0 = time.perf_counter()
            loss = runner.step(xs.to(runner.device), ys.to(runner.device))
            if args.grad_clip:  # the whole model's norm, however the plan holds its gradients
                runner.clip_grad_norm_(args.grad_clip)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)  # time the kernels, not their launch
            step_seconds.append(time.perf_counter() - t0)

            losses.append(loss)
            smooth_loss = loss if smooth_loss is None else 0.9 * smooth_loss + 0.1 * loss
            bar.set_postfix(loss=f"{smooth_loss:.3f}",
                            tok_s=f"{tokens_per_step / step_seconds[-1]:,.0f}", lr=f"{args.lr * scale:.1e}")
            if args.save_every and (step + 1) % args.save_every == 0:
                runner.save(args.checkpoint_dir / f"step-{step + 1:08d}", optimizer=opt, step=step + 1,
                            extra={"data_generator": generator_position(generator)})
        bar.close()

        comm = runner.comm_stats()
        if args.timeline:
            print_pipeline_timeline(runner, program)
        if args.save is not None:
            state = runner.full_state_dict()  # on every rank: consolidation may be collective
            if runner.is_main:
                args.save.parent.mkdir(parents=True, exist_ok=True)
                torch.save(state, args.save)
                print(f"saved {len(state)} tensors to {args.save}", flush=True)
        if args.save_full is not None:
            runner.save_full(args.save_full, optimizer=opt)  # gathered on every rank, rank 0 writes
            if runner.is_main:
                print(f"saved the full model to {args.save_full}", flush=True)
        if runner.is_main and losses:
            median_s = statistics.median(step_seconds)
            print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps | "
                  f"median step {median_s * 1e3:.1f} ms | "
                  f"{tokens_per_step / median_s:,.0f} tokens/s | "
                  f"rank 0 comm: {format_comm_stats(comm)}", flush=True)
    finally:
        runner.close()


if __name__ == "__main__":
    main()
