"""What checking a step's batch costs (`runtime.step.batch_checks`, `runtime.step.batch_identity`) against the step.

    OMP_NUM_THREADS=1 python benchmarks/bench_batch_checks.py --steps 10
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/bench_batch_checks.py --plan tp=2

Target: at most 1% of a step. The model is the example GPT (`examples/gpt.py:factory`, its
defaults: 4 layers, width 128, vocabulary 256, a batch of 16 x 128 tokens), compiled under
`--plan` (dp=1: bound in this process as a world of one). Timed, in process CPU time (on a
shared machine a wall-clock second includes waiting for a core), medians:

    step         runner.step(tokens, labels): forward, backward, every check included
    check        check_batch(rules, inputs): every rule of the model (two inputs' shape,
                 dtype and device; seq within wpe's rows; the labels' one pass)
    fingerprint  BatchIdentity.of(chunks): the batch's identity tp and pp ranks compare
    agreement    (tp or pp, in wall time) the step agreement's all-reduce on its own, at the
                 size the step program gives it: before the batch's identity it rode in tp's
                 first g, so under tp the whole call is what the comparison adds

On CUDA the label check also synchronises with the host once (module doc of batch_checks);
this CPU measurement does not show that.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import fxpar
from fxpar.frontend.batch_rules import batch_rules
from fxpar.runtime.step.batch_checks import check_batch
from fxpar.runtime.step.batch_identity import BatchIdentity

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import factory  # noqa: E402


def _world_of_one() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _median_seconds(call, repeats: int, clock=time.process_time) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        call()
        times.append(clock() - start)
    return statistics.median(times)


def _agreement_seconds(runner, repeats: int) -> float | None:
    """The wall time of the batch-carrying step agreement's all-reduce alone, or None where
    the plan has none (no tp or pp)."""
    program = runner.program.step_program(runner.rank)
    call = next((c for c in program.calls() if c.batch), None)
    if call is None:
        return None
    slots = torch.zeros(int(call.numel), dtype=call.dtype, device=runner.device)  # NCCL: on the GPU
    group = dist.new_group(list(program.group(call)))
    return _median_seconds(lambda: dist.all_reduce(slots, group=group), repeats, clock=time.perf_counter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checks", type=int, default=200)
    parser.add_argument("--plan", default="dp=1")
    args = parser.parse_args()
    model, (tokens, labels) = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = fxpar.compile(model, args.plan, example_inputs=(tokens, labels))
    if "WORLD_SIZE" not in os.environ:
        _world_of_one()
    runner = program.bind(timeout=60)
    try:
        rules = batch_rules(program.captured)
        chunks = list(zip(*(t.tensor_split(program.plan.microbatches) for t in (tokens, labels))))
        runner.step(tokens, labels)  # warm-up: the first step measures its activations
        step = _median_seconds(lambda: runner.step(tokens, labels), args.steps)
        costs = {
            "check": _median_seconds(lambda: check_batch(rules, (tokens, labels), device=runner.device), args.checks),
            "fingerprint": _median_seconds(lambda: BatchIdentity.of(chunks, runner.device), args.checks),
            "agreement": _agreement_seconds(runner, args.checks),
        }
    finally:
        runner.close()
    if runner.rank != 0:
        return
    print(f"example GPT under {args.plan!r}, batch {tuple(tokens.shape)}, torch threads {torch.get_num_threads()}")
    print(f"step         {step * 1e3:9.2f} ms (median of {args.steps})")
    for name, cost in costs.items():
        if cost is not None:
            print(f"{name:<12} {cost * 1e3:9.3f} ms (median of {args.checks})  = {100 * cost / step:.3f}% of a step")


if __name__ == "__main__":
    main()
