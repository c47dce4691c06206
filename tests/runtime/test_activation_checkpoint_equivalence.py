"""Activation checkpointing trains exactly as without it, and its memory is what the cost
model says.

Two torchrun launches, one worker each running many plans (`workers/recompute_worker.py`):
one device (the tiny GPT and a GPT with explicit attention and dropout 0.1, with and without
microbatches; GPT-2's layout, blocks in `transformer.h`; Llama's, in `layers`), and world 2 (dp=2, tp=2, tp=2 with sequence parallelism, pp=2 1F1B, pp=2
ZB-H1). Each plan runs under checkpoint=none, full and selective, 4 steps of AdamW (SGD with
momentum on some), and is compared with its own checkpoint=none run:

* the loss of every step, every gradient of the first step, every parameter after the last,
  at rel 1e-5 (fp32). Recomputation runs the same kernels on the same inputs, so the values
  are in fact bitwise equal; 1e-5 is the project's tolerance. With dropout on, that holds only
  because torch's checkpoint restores the RNG state before recomputing (each plan starts
  from the same RNG state, so its masks are the same draws too).
* `memory_stats()["activations"]`, the bytes held for backward at their peak in the first
  step (`runtime.step.saved_tensors`), equals the prediction for the rank
  (`rank_memory.predicted_memory`, the estimate's terms per pipeline coordinate) to the
  byte, and checkpointing lowers it: full below selective below none. The same equality
  holds under ZeRO-3 (with and without re-gathering for backward), metered only.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))

pytestmark = pytest.mark.multirank

MODES = ("none", "full", "selective")
ONE_DEVICE = ("", "mb=2", "explicit:", "explicit:mb=2", "gpt2:", "llama:")
TWO_RANKS = ("dp=2", "tp=2", "tp=2 sp=true", "pp=2 mb=2", "pp=2 mb=4 schedule=zb-h1")


# Metered only (checkpointing composed with ZeRO-3: tests/runtime/test_zero3_compositions.py):
# ZeRO-3's gathered weights are model state when re-gathered for backward, activations when
# kept from forward.
ZERO3 = ("dp=2 zero=3 checkpoint=none", "dp=2 zero=3 reshard_after_forward=false checkpoint=none")


def arguments(bases, sgd, extra=()):
    plans = [f"{base} checkpoint={mode}" for base in bases for mode in MODES]
    return plans + [f"{base} checkpoint={mode}@sgd" for base in sgd for mode in ("none", "full")] + list(extra)


@pytest.fixture(scope="module")
def one_device(module_torchrun):
    return module_torchrun("recompute_worker.py", 1, *arguments(ONE_DEVICE, sgd=("",)))


@pytest.fixture(scope="module")
def two_ranks(module_torchrun):
    return module_torchrun("recompute_worker.py", 2, *arguments(TWO_RANKS, sgd=("dp=2",), extra=ZERO3))


def baseline(plan: str) -> str:
    return plan.replace("checkpoint=full", "checkpoint=none").replace("checkpoint=selective", "checkpoint=none")


def assert_same_training(result: dict, reference: dict, plan: str) -> None:
    for step, (loss, expected) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert loss == pytest.approx(expected, rel=1e-5), (plan, step)
    for what in ("grads", "state"):
        assert result[what].keys() == reference[what].keys()
        for name, expected in reference[what].items():
            torch.testing.assert_close(result[what][name], expected, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name, w=what: f"{plan}: {w} {n}: {m}")


def assert_checkpointing_is_exact_and_metered(ranks: list[dict]) -> None:
    for results in ranks:
        for plan, result in results.items():
            assert_same_training(result, results[baseline(plan)], plan)
            measured = result["memory"]["activations"]
            assert measured == result["predicted"]["activations"], (plan, result["rank"])
        for plan in results:
            if "checkpoint=none" in plan and plan.replace("none", "full") in results and "@" not in plan:
                saved = {m: results[plan.replace("none", m)]["memory"]["activations"] for m in MODES}
                assert saved["full"] < saved["selective"] < saved["none"], (plan, saved)


def test_one_device_with_and_without_microbatches_and_dropout(one_device):
    assert_checkpointing_is_exact_and_metered(one_device)
    (results,) = one_device
    # Full keeps a block's input where the blocks saved everything: 1/6 of the tiny GPT's bytes.
    assert results[" checkpoint=full"]["memory"]["activations"] < results[" checkpoint=none"]["memory"]["activations"] / 5
    # Selective on explicit attention drops the s x s tensors: a quarter of what it saves.
    explicit = {m: results[f"explicit: checkpoint={m}"]["memory"]["activations"] for m in MODES}
    assert explicit["selective"] < 0.8 * explicit["none"]


def test_data_tensor_and_pipeline_parallel_plans(two_ranks):
    assert_checkpointing_is_exact_and_metered(two_ranks)
