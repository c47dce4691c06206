"""Draw the pictures in docs/pictures/ for the example GPT under a tp x pp plan; one command:

    python docs/make_pictures.py

It compiles `examples/gpt.py:factory()` (train_gpt.py's model: 4 layers, 4 heads, width 128,
a global batch of 16 x 128 tokens) under `tp=2 pp=2 mb=4`, with 1F1B and with ZB-H1, trains
three steps of each under torchrun on 4 gloo CPU ranks with `runner.record_timeline` on, and
draws:

    graph.svg          program.visualize(...): the partitioned graph at module detail
    gantt_1f1b.svg     the schedule the estimate simulates (the `cpu` profile, measured on this
    gantt_zb_h1.svg    machine) beside the last measured step, per pipeline rank
    memory.svg         memory per pipeline rank, predicted, beside what rank 0 and rank 2 hold
                       in parameters, gradients and optimizer state after the last step
                       (`runner.memory_stats()`; activations are not measured on the CPU)

`--no-run` skips torchrun and draws the simulated charts alone. Timings depend on the machine
that draws them; the pictures in the repository were drawn on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import fxpar  # noqa: E402
from fxpar.pictures.charts import memory_chart, schedule_chart  # noqa: E402
from fxpar.pictures.rank_memory import predicted_memory  # noqa: E402
from gpt import factory  # noqa: E402

PLANS = {"1f1b": "tp=2 pp=2 mb=4", "zb_h1": "tp=2 pp=2 mb=4 schedule=zb-h1"}
OUT = ROOT / "docs" / "pictures"
STEPS = 3


def measure(name: str, out: Path) -> None:
    """Inside torchrun: train plan `name` a few steps; rank 0 writes timelines and memory.

    One torchrun per plan: a process group torn down by `runner.close()` is not set up again
    in the same processes (gloo's second rendezvous on one port fails).
    """
    torch.set_num_threads(1)
    model, (tokens, labels) = factory()
    program = fxpar.compile(model, PLANS[name], example_inputs=(tokens, labels))
    runner = program.bind()
    try:
        optimizer = runner.optimizer(torch.optim.AdamW, lr=1e-3)
        for step in range(STEPS):
            runner.record_timeline = step == STEPS - 1
            runner.step(*runner.local_batch(tokens, labels))
            optimizer.step()
            held = runner.memory_stats()  # gradients are still there, before zero_grad
            optimizer.zero_grad()
        timelines = [None] * runner.world_size
        memories = [None] * runner.world_size
        torch.distributed.all_gather_object(timelines, runner.timeline())
        torch.distributed.all_gather_object(memories, held)
    finally:
        runner.close()
    if int(os.environ["RANK"]) == 0:
        pipeline = [program.mesh.rank_of(pp=i) for i in range(program.mesh.pp)]
        out.write_text(json.dumps({"timelines": [timelines[r] for r in pipeline],
                                   "memory": {r: memories[r] for r in pipeline}}))


def run_measurements() -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in PLANS:
            out = Path(folder) / f"{name}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                       __file__, "--measure", name, str(out)]
            subprocess.run(command, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
            results[name] = json.loads(out.read_text())
    return results


def draw(measured: dict | None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    model, inputs = factory()
    captured = fxpar.capture(model, inputs)
    programs = {name: fxpar.compile(captured, plan, hardware="cpu") for name, plan in PLANS.items()}
    programs["1f1b"].visualize(OUT / "graph.svg")
    for name, program in programs.items():
        simulated = program.estimate("cpu").pipeline
        runs = measured[name]["timelines"] if measured else None
        schedule_chart(OUT / f"gantt_{name}.svg", simulated, measured=runs,
                       title=f"example GPT, plan '{program.plan}': one step on 4 CPU ranks (gloo)")
    held = {int(r): terms for r, terms in measured["1f1b"]["memory"].items()} if measured else None
    memory_chart(OUT / "memory.svg", predicted_memory(programs["1f1b"]), measured=held,
                 title=f"plan '{programs['1f1b'].plan}': predicted per pipeline rank; hatched: the "
                       "parameters, gradients and AdamW state measured after a step")
    for path in sorted(OUT.glob("*.svg")):
        print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)  # torchrun worker
    parser.add_argument("--no-run", action="store_true", help="draw the simulated charts only")
    args = parser.parse_args()
    if args.measure is not None:
        measure(args.measure[0], Path(args.measure[1]))
        return
    draw(None if args.no_run else run_measurements())


if __name__ == "__main__":
    main()
