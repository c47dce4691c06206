"""Train a Hugging Face transformers model, built from a config, with fxpar under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --model llama --plan tp=2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model gpt2 --plan "dp=2 pp=2 mb=4"
    python examples/train_hf.py --model qwen2 --layers 4 --hidden 256 --config rope_theta=5e5

The model is the transformers class itself (`LlamaForCausalLM`, `GPT2LMHeadModel`, ...), with
random weights from `--seed` and nothing downloaded; fxpar gets it unmodified, with keyword
inputs as transformers wants them (`{"input_ids": ..., "labels": ...}`) and takes the loss
from its output. The data is `train_gpt.py`'s: the standard library's source, one token per
byte. Causal models learn to predict the next byte; BERT learns to fill in masked bytes
(15% of positions, the masked-LM objective of Devlin et al. 2019), its labels -100 elsewhere.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example modules

import fxpar  # noqa: E402
from text_data import VOCAB_SIZE, ByteDataset, load_stdlib_text  # noqa: E402
from train_gpt import (  # noqa: E402
    ensure_distributed_env,
    format_comm_stats,
    learning_rate,
    print_pipeline_timeline,
)

MASK, PAD = VOCAB_SIZE, VOCAB_SIZE + 1  # BERT's extra token ids beyond the 256 bytes


def family_config(family: str, *, layers: int, hidden: int, heads: int, seq: int):
    """The transformers config of `family` at this size; dropout off, no KV cache."""
    import transformers

    decoder = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=4 * hidden,
                   num_hidden_layers=layers, num_attention_heads=heads,
                   max_position_embeddings=seq, use_cache=False)
    grouped = dict(decoder, num_key_value_heads=max(1, heads // 2))  # grouped-query attention
    families = {
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=VOCAB_SIZE, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False),
        "llama": lambda: transformers.LlamaConfig(**grouped),
        "mistral": lambda: transformers.MistralConfig(**grouped),
        "qwen2": lambda: transformers.Qwen2Config(**grouped),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**decoder, hidden_dropout=0.0,
                                                       attention_dropout=0.0),
        "bert": lambda: transformers.BertConfig(
            vocab_size=VOCAB_SIZE + 2, hidden_size=hidden, intermediate_size=4 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=seq,
            pad_token_id=PAD, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    }
    if family not in families:
        sys.exit(f"--model {family!r}: choose one of {', '.join(families)}")
    return families[family]()


def build_model(family: str, config) -> torch.nn.Module:
    import transformers

    if family == "bert":
        return transformers.BertForMaskedLM(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def make_batch(family: str, x: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Keyword inputs for one global batch of byte sequences `x` (B, T)."""
    if family != "bert":
        return {"input_ids": x, "labels": x.clone()}  # the model shifts labels itself
    masked = torch.rand(x.shape, generator=generator) < 0.15
    return {"input_ids": x.masked_fill(masked, MASK), "labels": x.masked_fill(~masked, -100)}


def parse_overrides(items: list[str]) -> dict:
    """`["rope_theta=5e5", "tie_word_embeddings=False"]` -> a dict of Python literals."""
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    return overrides


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    world_size = os.environ.get("WORLD_SIZE", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama",
                        help="gpt2, llama, mistral, qwen2, gpt_neox or bert")
    parser.add_argument("--plan", default=f"dp={world_size}",
                        help='fxpar plan, e.g. "dp=2 tp=2" (default: dp=WORLD_SIZE)')
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more config fields, e.g. rope_theta=5e5")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    parser.add_argument("--seq", type=int, default=128, help="sequence length, in bytes")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1337, help="model init and data order")
    parser.add_argument("--timeline", action="store_true",
                        help="with a pipeline: print the last step's Gantt chart (rank 0)")
    return parser.parse_args(argv)


def decayed_parameter_names(model: torch.nn.Module) -> list[str]:
    """The parameters Hugging Face's Trainer applies weight decay to: all but biases and
    normalisation weights (`Trainer.get_decay_parameter_names`, its patterns)."""
    from transformers.trainer_pt_utils import get_parameter_names

    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    return get_parameter_names(model, [torch.nn.LayerNorm], patterns)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ensure_distributed_env()
    config = family_config(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                           seq=args.seq)
    for key, value in parse_overrides(args.config).items():
        setattr(config, key, value)

    torch.manual_seed(args.seed)  # the same weights on every rank
    model = build_model(args.model, config).train()
    dataset = ByteDataset(load_stdlib_text())
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    example = make_batch(args.model, dataset.get_batch("train", args.batch, args.seq, generator)[0],
                         generator)
    try:
        program = fxpar.compile(model, args.plan, example_inputs=example)
    except fxpar.PlanError as error:
        sys.exit(f"plan {args.plan!r} does not fit this model and batch: {error}")

    runner = program.bind()
    try:
        if runner.device.type == "cpu":  # share the cores instead of oversubscribing them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // runner.world_size))
        decay = set(decayed_parameter_names(model))  # the rest (biases, norms) steps without decay
        groups = [{"params": [n for n, _ in model.named_parameters() if n in decay]},
                  {"params": [n for n, _ in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
        opt = runner.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                               param_groups=groups)
        if runner.is_main:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"{type(model).__name__} ({n_params / 1e6:.2f}M parameters), plan "
                  f"{str(program.plan)!r} on {runner.world_size} rank(s), {runner.device}", flush=True)
        step_seconds: list[float] = []
        losses: list[float] = []
        bar = tqdm(range(args.steps), disable=not runner.is_main, desc="train", unit="step")
        for step in bar:
            lr = learning_rate(step, max_lr=args.lr, warmup_steps=args.warmup_steps,
                               total_steps=args.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            x = dataset.get_batch("train", args.batch, args.seq, generator)[0]
            batch = runner.local_batch(make_batch(args.model, x, generator))  # this rank's rows
            runner.record_timeline = args.timeline and step == args.steps - 1
            start = time.perf_counter()
            loss = runner.step({k: v.to(runner.device) for k, v in batch.items()})
            opt.step()
            opt.zero_grad()
            step_seconds.append(time.perf_counter() - start)
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}")
        bar.close()
        comm = runner.comm_stats()
        if args.timeline:
            print_pipeline_timeline(runner, program)
        if runner.is_main and losses:
            print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps | median "
                  f"step {statistics.median(step_seconds) * 1e3:.1f} ms | rank 0 comm: "
                  f"{format_comm_stats(comm)}", flush=True)
    finally:
        runner.close()


if __name__ == "__main__":
    main()
