"""Context parallelism (`cp=N`) trains Hugging Face decoders and BERT exactly as one device does.

Each cp rank computes every layer for its slice of the sequence, attention against the keys
and values gathered from every rank (`passes.context_parallel`). The models of
tests/hf_models.py, unmodified: Llama (grouped-query attention, rotary positions from position
ids), Qwen2 (q/k/v biases), Mistral (a sliding-window mask built from positions), GPT-2
(learned position embeddings) and BERT (bidirectional, a padding mask). Their labels end in a
different number of ignored targets per row, and Hugging Face shifts them by one inside the
loss: a rank's slice must see the label of the next rank's first token, which only holds if
the shift is computed on the whole sequence, as one device computes it.

Each composed with what the plan offers: dp (with microbatches), tp (the gathered keys and
values are each rank's heads), pp (a stage receives its slice of the boundary), ZeRO 1-3
(gradients summed over cp before the dp buckets shard them), activation checkpointing (keys
and values gathered again in backward) and the chunked loss. (bf16-mixed: test_mixed_precision_equivalence; compiled mode:
test_compiled_equivalence.)

The same checks as test_hf_equivalence (`assert_equivalent`): after 3 AdamW steps, the loss
of every step, every gradient of the first step and all parameters together, fp32 at relative
1e-5 (the same sums in another order: a rank's attention row reads the same keys, its
gradients are summed over the cp ranks); every collective equal to the compiler's
prediction; the rank's memory equal to the estimate's, to the byte.
"""

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_equivalence import check_jobs, train_single_device  # noqa: E402

pytestmark = pytest.mark.multirank
DECODERS = ["llama", "qwen2", "mistral"]
ON_TWO_RANKS = [f"{m} sdpa cp=2" for m in (*DECODERS, "gpt2", "bert")] + [
    # recomputation re-runs a block (or attention's core) on the rank's slice and gathers the
    # keys and values again (`recompute_regions.regathered`); the chunked loss takes its
    # labels' slice.
    "llama sdpa cp=2 checkpoint=full", "qwen2 sdpa cp=2 checkpoint=selective", "mistral sdpa cp=2 loss=chunked",
    # mixtures of experts: each rank routes its own slice's tokens (the sort and counts the
    # experts module makes are its own, sized for the slice); DeepSeek-V3's group-limited router;
    # Llama 4's block copies each of its tokens per expert (`repeat`)
    "mixtral sdpa cp=2", "deepseek_v3 sdpa cp=2", "llama4 sdpa cp=2",
]
ON_FOUR_RANKS = [f"{m} sdpa {plan}" for m in DECODERS for plan in ("dp=2 cp=2", "cp=2 tp=2", "cp=4", "cp=2 pp=2 mb=2")] + [
    "llama sdpa cp=2 tp=2 checkpoint=full",  # keys and values gathered again inside a block with tp's f
]
ZERO_ON_FOUR_RANKS = [
    "gpt2 sdpa dp=2 cp=2 mb=2",  # microbatches: the count of valid targets over dp only
    # ZeRO shards over dp; each gradient is summed over cp before its bucket is reduce-scattered
    "llama sdpa dp=2 cp=2 zero=1", "qwen2 sdpa dp=2 cp=2 zero=2 mb=2", "mistral sdpa dp=2 cp=2 zero=3",
]


@pytest.fixture(scope="module")
def references():
    """One device's training of each model and attention, trained once for the module."""
    return functools.cache(train_single_device)


def test_cp_on_two_ranks_matches_single_device(torchrun, references):
    check_jobs(torchrun, references, ON_TWO_RANKS)


def test_cp_composed_with_dp_tp_and_pp_on_four_ranks_matches_single_device(torchrun, references):
    check_jobs(torchrun, references, ON_FOUR_RANKS, world=4)


def test_cp_with_zero_on_four_ranks_matches_single_device(torchrun, references):
    check_jobs(torchrun, references, ZERO_ON_FOUR_RANKS, world=4)
