"""A step's batch checked against the compiled program (`runtime.step.batch_checks`): each bad
input a BatchError naming the input, the expected, the got and a fix, raised by
`runner.step` before the step communicates. Single-process: the checks are called directly
(they read `batch_rules(program.captured)`, the same under every plan) and through a runner
bound in a world of one; one 2-rank launch shows both tp ranks raising at step."""

import re
import socket
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fxpar import BatchError
import fxpar
from fxpar.frontend.batch_rules import batch_rules
from fxpar.runtime.step.batch_checks import check_batch

sys.path.insert(0, str(Path(__file__).parents[1]))
from small_gpt import small_capture  # noqa: E402
from test_batch_rules import tagger_rules  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import factory  # noqa: E402

CPU = torch.device("cpu")
TOKENS = torch.randint(0, 64, (4, 16))  # for small_capture(): vocabulary 64, block_size 16


def check(*inputs: torch.Tensor, device: torch.device = CPU) -> None:
    check_batch(batch_rules(small_capture()), small_capture().arrange(inputs, {}), device=device)


# -- labels ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocabulary_256():
    """The example GPT with a vocabulary of 256 under tp=2 (its cross entropy vocabulary-
    parallel, `passes.tensor_parallel.vocab_loss`) and dp=2."""
    model, inputs = factory(n_layer=1, n_head=2, n_embd=16, vocab_size=256, seq=16, batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = fxpar.capture(model, inputs)
    return {plan: fxpar.compile(captured, plan) for plan in ("tp=2", "dp=2")}


@pytest.mark.parametrize("plan", ["tp=2", "dp=2"])
@pytest.mark.parametrize("label", [300, -1, 256])
def test_a_label_outside_the_vocabulary_names_its_value_and_position(vocabulary_256, plan, label):
    program = vocabulary_256[plan]
    tokens = torch.randint(0, 256, (4, 16))
    labels = tokens.clone()
    labels[3, 5] = label
    with pytest.raises(BatchError) as caught:
        check_batch(batch_rules(program.captured), (tokens, labels), device=CPU)
    assert str(caught.value) == (
        f"input 1 (targets) holds a label outside the vocabulary: targets[3, 5] = {label} (indices into the "
        "batch this rank's step was given); the loss (cross_entropy_loss in module '<root module>') takes a "
        "class in [0, 256) or the ignore index -100. Fix: map such tokens into the vocabulary, or set them to "
        "-100 so that the loss skips them"
    )


@pytest.mark.parametrize("plan", ["tp=2", "dp=2"])
def test_the_ignore_index_and_the_whole_vocabulary_are_accepted(vocabulary_256, plan):
    labels = torch.arange(64).reshape(4, 16) * 4 + 3  # 3 ... 255
    labels[1:, -3:] = -100
    check_batch(batch_rules(vocabulary_256[plan].captured), (labels.clamp(min=0), labels), device=CPU)


def test_an_ignore_index_inside_the_vocabulary_is_a_class_like_any_other():
    rules = tagger_rules()  # nll_loss over 5 classes, ignore_index 7
    features = torch.randn(2, 6, 4)
    for fine in (0, 4, 7):
        check_batch(rules, (features, torch.full((2, 6), fine)), device=CPU)
    for bad in (5, -1, -100):
        with pytest.raises(BatchError, match=rf"labels\[0, 0\] = {bad}, and 11 more .* \[0, 5\) or the ignore index 7"):
            check_batch(rules, (features, torch.full((2, 6), bad)), device=CPU)


# -- shapes, dtypes, devices ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ((TOKENS,), "this program takes 2 inputs ['idx', 'targets'] (as captured), got 1. Fix: pass the "
                    "example's inputs in its order: (idx, targets)"),
        ((TOKENS, TOKENS[None]), "input 1 (targets) has 3 dims, shape (1, 4, 16); the program was compiled for "
                                 "2: torch.int64 of shape (batch, seq). Fix: pass targets shaped as the example "
                                 "was (its dim 0 the batch, dim 1 the sequence)"),
        ((TOKENS[:0], TOKENS[:0]), "input 0 (idx) is empty: dim 0 (batch) has size 0, shape (0, 16); a step needs "
                                   "at least one row there"),
        ((TOKENS[:, :0], TOKENS[:, :0]), "input 0 (idx) is empty: dim 1 (seq) has size 0, shape (4, 0)"),
        ((TOKENS, TOKENS.float()), "input 1 (targets) is torch.float32; the program was compiled for torch.int64 "
                                   "of shape (batch, seq). Fix: targets.to(torch.int64)"),
        ((TOKENS, TOKENS.to("meta")), "input 1 (targets) is on device meta, this runner on cpu. Fix: move the "
                                      "batch to the runner's device (targets.to(runner.device)) before runner.step"),
        ((TOKENS, [[1, 2]]), "input 1 (targets) is [[1, 2]] (list); the program takes a tensor there: torch.int64 "
                             "of shape (batch, seq), as in the example. Fix: pass it as a tensor"),
        ((TOKENS, TOKENS[:, :8]), "input 1 (targets) has size 8 in dim 1 (seq), input 0 (idx) 16 in dim 1: the "
                                  "program reads both as seq"),
        ((torch.randint(0, 64, (4, 17)),) * 2,
         "input 0 (idx) has 17 positions in dim 1 (seq), more than the model's 16: wpe.weight has 16 rows, read at "
         "arange(seq) by embedding_1 in module 'wpe'. Fix: cut sequences to at most 16 tokens, or build the model "
         "with a longer position table (block_size, max_position_embeddings)"),
    ],
    ids=["count", "ndim", "no rows", "no tokens", "dtype", "device", "not a tensor", "unlike sizes", "too long"],
)
def test_a_batch_unlike_the_example_is_a_batch_error(inputs, message):
    with pytest.raises(BatchError, match=re.escape(message)):
        check(*inputs)


def test_a_batch_on_another_device_than_the_runner():
    with pytest.raises(BatchError, match=re.escape("input 0 (idx) is on device cpu, this runner on cuda:0")):
        check(TOKENS, TOKENS, device=torch.device("cuda", 0))


def test_a_fixed_dim_of_another_size():
    with pytest.raises(BatchError, match=re.escape(
        "features has size 3 in dim 2, shape (2, 6, 3); the program fixed that dim to 4, the example's "
        "(torch.float32 of shape (batch, seq, 4)). Fix: give every batch size 4 there")):
        check_batch(tagger_rules(), (torch.randn(2, 6, 3), torch.zeros(2, 6, dtype=torch.long)), device=CPU)


# -- at runner.step ---------------------------------------------------------------------------


@pytest.fixture
def runner(monkeypatch):
    """The small GPT compiled for one device and bound in this process (a world of one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bound = fxpar.compile(small_capture(), "dp=1").bind(timeout=10)
    yield bound
    bound.close()


def test_runner_step_raises_before_the_step_and_goes_on_after(runner):
    """Torch raised IndexError from inside the loss here; now the step stops at its top (each
    call still counts as a step, `runtime.step.agreement`), and the next batch trains."""
    labels = TOKENS.clone()
    labels[2, 7] = 64
    with pytest.raises(BatchError, match=re.escape("targets[2, 7] = 64 (indices")):
        runner.step(TOKENS, labels)
    with pytest.raises(BatchError, match="is on device meta"):
        runner.step(TOKENS.to("meta"), TOKENS)
    assert runner._context.steps == 2 and runner.rng_state()["step"] == 0
    assert torch.isfinite(torch.tensor(runner.step(TOKENS, TOKENS)))


@pytest.mark.multirank
def test_every_rank_given_a_bad_label_raises_before_the_step_communicates(torchrun):
    """tp=2 (the vocabulary-parallel cross entropy trained on a finite loss here), pp=2 (only
    the last stage reads labels: every rank is given them and checks them) and dp=2 with
    ZeRO-1 and bf16 (each rank raises for its own half): each rank stops at the top of the
    step, issuing nothing, and the next step trains on every rank."""
    plans = ("tp=2", "pp=2 mb=2", "dp=2 zero=1 precision=bf16-mixed")
    ranks = torchrun("batch_worker.py", 2, *plans, timeout=240)
    held = {"tp=2": ("targets[1, 3] = 64, and 1 more",) * 2, "pp=2 mb=2": ("targets[1, 3] = 64, and 1 more",) * 2,
            "dp=2 zero=1 precision=bf16-mixed": ("targets[1, 3] = 64 (", "targets[1, 2] = -1 (")}
    for plan in plans:
        for rank, outcome in enumerate(ranks):
            assert outcome[plan]["error"].startswith("input 1 (targets) holds a label outside the vocabulary: "
                                                     + held[plan][rank]), (plan, rank, outcome[plan])
            assert outcome[plan]["issued"] == {} and outcome[plan]["waited"] < 1, (plan, rank)
            assert 0 < outcome[plan]["loss"] < 10, (plan, rank)
