"""torchrun worker: trains a model with dropout under each plan given, saves what
tests/runtime/test_random_equivalence.py compares.

    torchrun --standalone --nproc-per-node 4 random_worker.py OUT_DIR "dp=2 tp=2 mb=2 rng=exact" \
        "hf-gpt2:dp=2 tp=2 rng=exact" ...

A plan trains the tiny GPT (dropout 0.1), or, after "hf-gpt2:", Hugging Face's GPT-2 with its
default dropouts (0.1 on embeddings, attention probabilities and both residual branches) and
eager attention (`MODELS`).

Before each bind every process seeds its own generator differently (rank 0 with 0, the others
with a number of their own and of the run), as a script seeding `base + rank` would: the job's
seed is rank 0's whatever the others set. A plan given twice is trained twice (its second run
under `plan#2`), with other per-process seeds, to show a run reproduces. Last, the last plan is
bound with `seed=5` on every rank, then with each rank's own seed, which must fail everywhere.

Besides losses, gradients and the final state, each rank saves its own copy of every parameter
tensor parallelism replicates, and, for rng=fast plans, the masks its draws give at the next
step for microbatches 0 and 1 (each draw op called with this rank's shapes, as its module does).
"""

import os
import sys
from pathlib import Path

import sympy
import torch

import fxpar
from fxpar.errors import BindError
from fxpar.ir import meta
from fxpar.ir.placement import Replicate, local_shape
from fxpar.ops.random_ops import DrawSlice
from fxpar.ops.random_streams import bound_random
from tiny_training import GPT, OPTIMIZER, GPTConfig, fresh_capture, global_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402

DROPOUT = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
STEPS = 3
DRAWS = (torch.ops.fxpar.random_like.default, torch.ops.fxpar.attention_dropout_mask.default)


def hf_gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=hf_models.VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     use_cache=False, bos_token_id=hf_models.VOCAB - 1,
                                     eos_token_id=hf_models.VOCAB - 1, attn_implementation="eager")
    return hf_models.LossOf(transformers.AutoModelForCausalLM.from_config(config).train())


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(DROPOUT)


# name -> (model builder, the steps' global batches, AdamW's options)
MODELS = {
    "gpt": (_gpt, lambda: global_batches()[:STEPS], OPTIMIZER),
    "hf-gpt2": (hf_gpt2, lambda: [(b["input_ids"], b["labels"]) for b in hf_models.batches("gpt2", STEPS)],
                hf_models.OPTIMIZER),
}


def model_and_plan(entry: str) -> tuple[str, str]:
    """("hf-gpt2", "dp=2") for "hf-gpt2:dp=2"; ("gpt", entry) for a plain plan."""
    name, _, plan = entry.rpartition(":")
    return name or "gpt", plan


def local_tensor(program, node, microbatch_sizes):
    """An empty tensor of this rank's shape of `node`'s value at one microbatch's sizes."""
    shape = [int(sympy.sympify(program.captured.readable(d)).subs(microbatch_sizes)) for d in node.meta["val"].shape]
    return torch.empty(local_shape(shape, meta.placements(node), program.mesh.sizes))


def masks(runner, program, tokens):
    """(op index, microbatch) -> this rank's mask of every draw at the runner's next step."""
    readable = {s.name: s for s in program.captured.example_sizes}
    sizes = {readable["batch"]: tokens.shape[0] // program.plan.microbatches, readable["seq"]: tokens.shape[1]}
    stream, found = bound_random(), {}  # the runner bound its stream at bind
    for module in runner.modules:
        for node in module.graph.nodes:
            if node.target in DRAWS:
                n_likes = 1 if node.target is DRAWS[0] else 2
                likes = [local_tensor(program, a, sizes) for a in node.args[:n_likes]]
                for microbatch in (0, 1):
                    with stream.at(microbatch):
                        found[(node.args[3], microbatch)] = node.target(*likes, *node.args[n_likes:])
    return found


def main(out_dir: Path, plans: list[str]) -> None:
    torch.set_num_threads(1)
    results = {}
    runs: dict[str, int] = {}
    for entry in plans:
        runs[entry] = runs.get(entry, 0) + 1
        key = entry if runs[entry] == 1 else f"{entry}#{runs[entry]}"
        name, plan = model_and_plan(entry)
        build, batches, options = MODELS[name]
        program = fxpar.compile(fresh_capture(f"random {name}", batches()[0], build=build)[1], plan)
        program.check()
        rank = int(os.environ["RANK"])
        torch.manual_seed(0 if rank == 0 else 1000 * runs[entry] + rank)  # each process its own
        runner = program.bind(timeout=60)
        optimizer = runner.optimizer(torch.optim.AdamW, **options)
        losses, grads = [], None
        for tokens, labels in batches():
            losses.append(runner.step(*runner.local_batch(tokens, labels)))
            if grads is None:
                grads = runner.full_gradients()
            optimizer.step()
            optimizer.zero_grad()
        replicated = {
            name: runner.module.get_parameter(name).detach().clone()
            for name, node in meta.parameter_nodes(runner.module.graph).items()
            if isinstance(meta.placement(node, "tp"), Replicate)
        }
        results[key] = {
            "losses": losses, "grads": grads, "state": runner.full_state_dict(),
            "replicated": replicated, "coord": program.mesh.coord(runner.rank),
            "masks": masks(runner, program, tokens) if program.plan.rng == "fast" else None,
            "rng_state": runner.rng_state(),
            "slices": {node.args[3]: DrawSlice(*node.args[-6:])
                       for node in runner.module.graph.nodes if node.target in DRAWS},
        }
        runner.close()
    # The seed given to bind: the same on every rank, or a BindError on every rank.
    runner = program.bind(timeout=60, seed=5)
    results["seed=5"] = runner.rng_state()
    runner.close()
    try:
        program.bind(timeout=60, seed=rank)
    except BindError as error:
        results["seed=rank"] = str(error)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
