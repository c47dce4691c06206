"""Tier 3: ZeRO-3 composed with bf16-mixed's fp32 gradient reduction and with activation
checkpointing trains as its references do, and holds what the estimate says.

One world-2 launch trains the example Llama for 5 AdamW steps under every plan below
(tests/workers/train_worker.py); one world-4 launch composes both with tensor parallelism
(sequence parallelism, microbatches) and with a 1F1B pipeline on the tiny GPT; one world-2 launch checkpoints and
resumes the fp32-reduced plan (tests/workers/checkpoint_worker.py).

bf16-mixed with ZeRO-3 (`passes.zero3`). With `reduce_dtype=fp32` (the default) each rank's
pieces are fp32 and are their own masters (FSDP2's sharded fp32 parameters): the gather casts
them to bf16, the layer computes in bf16, and the reduce-scatter sums the bf16 gradients cast
to fp32, in fp32, into the pieces' fp32 gradients, which AdamW steps with. With
`reduce_dtype=bf16` the pieces are bf16 working copies with fp32 masters and the sum runs in
bf16. Against `tiny_training.train_data_parallel_bf16`, that arithmetic written out in plain
PyTorch over two ranks' shares of the batch (microbatches accumulated in the reduce dtype),
relative 1e-6: measured bitwise equal parameters, gradients and AdamW moments, losses 6e-8
apart (the loss's fp32 sum over ranks). Against one device's fp32 training, bf16's stated
tolerances (`test_mixed_precision_equivalence`). The fp32 reduction is what it says: its
first-step gradients equal the fp32 sum of the ranks' bf16 gradients exactly, where the bf16
reduction's are that sum rounded to bf16 (measured 1.7e-3 relative, bf16's 2^-9 half-ulp
scale), and they are closer to fp32 training's (measured 7.39e-3 against 7.57e-3). Model
state: 4P/N fp32 pieces, 4P/N fp32 gradients, 8P/N AdamW moments (`cost.memory`), equal to
the estimate; the step program's calls say bf16 for the gathers and fp32 for the
reduce-scatters, and are what each step issued (`comm_stats` equal to the estimate).

Activation checkpointing with ZeRO-3 (`runtime.step.recompute`). Exact against checkpoint=none
under the same ZeRO-3 plan (rel 1e-5, the project's tolerance; measured bitwise) and
against one device (`assert_equivalent`, rel 1e-5), full and selective, with and without
re-gathering for backward, and under bf16-mixed (bitwise as the same plan without
checkpointing). The saved-activation bytes (`memory_stats()["activations"]`, counted by the
meter from what autograd and the checkpoint regions hold) equal the estimate to the byte. The
blocks' gathered weights are not alive from forward to backward: with re-gathering, ZeRO-3
under checkpoint=full holds the bytes plain data parallelism under checkpoint=full holds
(each block's input) plus the root layer's whole head and final norm (not gathered again, as
FSDP2 keeps its root), while keeping them all gathered (reshard_after_forward=false) holds
each layer's whole weights on top, as the estimate says. Every call either issues is the step
program's (the step guard admits nothing else; the recomputation issues no collective).
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from test_data_parallel_equivalence import assert_equivalent  # noqa: E402
from test_mixed_precision_equivalence import SAME_ARITHMETIC, assert_same_arithmetic, assert_within_bf16  # noqa: E402
from test_tensor_parallel_equivalence import assert_collectives_as_predicted  # noqa: E402
from test_zero_equivalence import assert_model_state_as_predicted  # noqa: E402
from tiny_training import build_model, train_data_parallel_bf16, train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank

BF16 = "precision=bf16-mixed"
FP32_REDUCE, BF16_REDUCE = f"dp=2 zero=3 {BF16}", f"dp=2 zero=3 {BF16} reduce_dtype=bf16"
ACCUMULATED = f"dp=2 zero=3 mb=2 {BF16} reshard_after_forward=false"
MIXED = (FP32_REDUCE, BF16_REDUCE, ACCUMULATED)
NONE, FULL, SELECTIVE = (f"dp=2 zero=3 checkpoint={m}" for m in ("none", "full", "selective"))
KEPT_NONE, KEPT_FULL = (f"dp=2 zero=3 reshard_after_forward=false checkpoint={m}" for m in ("none", "full"))
DP_FULL = "dp=2 checkpoint=full"
MIXED_FULL = f"dp=2 zero=3 checkpoint=full {BF16}"
RECOMPUTED = (NONE, FULL, SELECTIVE, KEPT_NONE, KEPT_FULL, DP_FULL)
FOUR_RANKS = ("dp=2 tp=2 sp=true zero=3 checkpoint=full", "dp=2 tp=2 zero=3 checkpoint=selective",
              f"dp=2 tp=2 zero=3 mb=2 {BF16}", "dp=2 pp=2 zero=3 mb=4 checkpoint=full")


@pytest.fixture(scope="module")
def two_ranks(module_torchrun):
    return module_torchrun("train_worker.py", 2, *MIXED, *RECOMPUTED, MIXED_FULL, env={"FXPAR_TEST_MODEL": "llama"})


@pytest.fixture(scope="module")
def llama_fp32():
    return train_single_device("llama") | {"initial": build_model("llama").state_dict()}


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[n].flatten().float() for n in sorted(grads)])


def assert_memory_as_estimated(result: dict, keys=None) -> None:
    for key in keys or ("params", "grads", "optimizer", "activations"):
        assert result["memory"][key] == result["estimated_memory"][key], key


def test_zero3_reduces_bf16_gradients_in_fp32(two_ranks, llama_fp32):
    references = {
        FP32_REDUCE: train_data_parallel_bf16("llama", reduce_dtype=torch.float32),
        BF16_REDUCE: train_data_parallel_bf16("llama", reduce_dtype=torch.bfloat16),
        ACCUMULATED: train_data_parallel_bf16("llama", microbatches=2, reduce_dtype=torch.float32),
    }
    for plan, reference in references.items():
        for result in (ranks[plan] for ranks in two_ranks):
            assert_same_arithmetic(result, reference)
            found, expected = _flat(result["grads"]), _flat(reference["grads"])
            assert (found - expected).norm() <= SAME_ARITHMETIC * expected.norm(), plan
            assert_within_bf16(result, llama_fp32)
            assert_collectives_as_predicted(result)
            assert_memory_as_estimated(result)
            stored = "torch.bfloat16" if plan == BF16_REDUCE else "torch.float32"
            assert result["dtypes"]["parameters"] == [stored] and result["dtypes"]["stepped"] == ["torch.float32"]
            wire = {c.tag: c.dtype for c in result["predicted"] if "parameters" in c.tag}
            assert wire["dp gather_parameters"] == torch.bfloat16
            assert wire["dp gather_parameters (backward)"] == (torch.bfloat16 if plan == BF16_REDUCE else torch.float32)
    # fp32 pieces, gradients and AdamW moments: fp32 ZeRO-3's 4P/N + 4P/N + 8P/N.
    for plan in (FP32_REDUCE, ACCUMULATED):
        assert_model_state_as_predicted(two_ranks[0][plan], zero=3, dp=2)
    # The reduction's own rounding: none in fp32, bf16's in bf16; fp32 lands closer to fp32 training.
    exact_sum = _flat(references[FP32_REDUCE]["grads"])
    rounded = (_flat(two_ranks[0][BF16_REDUCE]["grads"]) - exact_sum).norm() / exact_sum.norm()
    assert 2e-4 < rounded < 4e-3, rounded
    fp32_training = _flat(llama_fp32["grads"])
    distance = {plan: (_flat(two_ranks[0][plan]["grads"]) - fp32_training).norm() for plan in (FP32_REDUCE, BF16_REDUCE)}
    assert distance[FP32_REDUCE] < distance[BF16_REDUCE], distance


def test_zero3_checkpointing_is_exact_and_frees_the_gathered_weights(two_ranks, llama_fp32):
    for ranks in two_ranks:
        for plan in RECOMPUTED + (MIXED_FULL,):
            result = ranks[plan]
            baseline = ranks[{FULL: NONE, SELECTIVE: NONE, KEPT_FULL: KEPT_NONE, MIXED_FULL: FP32_REDUCE}.get(plan, NONE)]
            for step, (loss, expected) in enumerate(zip(result["losses"], baseline["losses"], strict=True)):
                assert loss == pytest.approx(expected, rel=1e-5), (plan, step)
            for what in ("grads", "state"):
                for name, expected in baseline[what].items():
                    torch.testing.assert_close(result[what][name], expected, rtol=1e-5, atol=1e-7)
            if plan != MIXED_FULL:
                assert_equivalent(result, llama_fp32, tied=False, model="llama")
            assert_collectives_as_predicted(result)
            # (DDP's last bucket holds the loss's slot, 4 bytes the estimate leaves out)
            assert_memory_as_estimated(result, ("activations",) if plan == DP_FULL else None)
        saved = {plan: ranks[plan]["memory"]["activations"] for plan in RECOMPUTED + (MIXED_FULL,)}
        # The blocks' whole weights are gathered again for backward, so ZeRO-3 saves what plain
        # data parallelism saves, plus the root's layer's whole weights that backward reads
        # (head and final norm): that layer is not gathered again (`passes.zero3`).
        weights = dict(build_model("llama").named_parameters())
        root = sum(weights[n].numel() for n in ("lm_head.weight", "norm.weight"))
        assert saved[FULL] == saved[DP_FULL] + 4 * root < saved[SELECTIVE] < saved[NONE], saved
        # Kept gathered, every whole fp32 weight that backward reads is held from forward on:
        # the blocks' (region inputs) too; the embedding's backward reads only the token ids.
        # (No piece is padded: even sizes.)
        read = sum(p.numel() for n, p in weights.items() if n != "embed_tokens.weight")
        assert saved[KEPT_FULL] - saved[FULL] == 4 * (read - root), (saved, read, root)
        assert saved[MIXED_FULL] < saved[FULL]  # bf16 activations


def test_zero3_checkpointing_and_bf16_with_tensor_parallelism_and_a_pipeline(torchrun):
    ranks = torchrun("train_worker.py", 4, *FOUR_RANKS)
    reference = train_single_device("gpt")
    fp32 = reference | {"initial": build_model("gpt").state_dict()}
    for plan in FOUR_RANKS:
        for results in ranks:
            result = results[plan]
            if BF16 in plan:
                assert_within_bf16(result, fp32)
            else:
                assert_equivalent(result, reference)
            assert_collectives_as_predicted(result)
            if not result["schedule_row"]:  # (with a pipeline the estimate reports one rank)
                assert_memory_as_estimated(result)
            elif result["rank"] == result["estimated_rank"]:
                assert_memory_as_estimated(result, ("params", "grads", "optimizer"))


def test_zero3_fp32_pieces_checkpoint_and_resume_exactly(torchrun):
    """With reduce_dtype=fp32 the pieces are the fp32 masters, and a resharding checkpoint
    (`runner.save`) holds them: saved after 3 steps and loaded under the same plan, 2 more
    steps are the uninterrupted run's (bitwise), and loaded under fp32 DDP the state is the
    saved full state."""
    plan = f"dp=2 zero=3 {BF16}"
    jobs = [f"save|{plan}|m|3", f"load|{plan}|m|2", f"save|{plan}|u|5", "load|dp=2|m|0"]
    ranks = torchrun("checkpoint_worker.py", 2, *jobs)
    folder = ranks[0]["folder"]
    saved, uninterrupted = load_file(folder / "m.safetensors"), load_file(folder / "u.safetensors")
    for results in ranks:
        resumed = results[jobs[1]]
        assert resumed["losses"] == pytest.approx(results[jobs[2]]["losses"][3:], rel=1e-7)
        for name, expected in uninterrupted.items():
            assert torch.equal(resumed["state"][name], expected), name
        for name, expected in saved.items():
            assert torch.equal(results[jobs[3]]["state"][name], expected), name
