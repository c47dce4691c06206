"""What a step's batch must be, read off the captured graph (`fxpar.frontend.batch_rules`): the labels
that feed the loss traced to their input, the vocabulary and ignore index, and the sequence
bound a learned position table sets."""

import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.frontend.batch_rules import BatchRules, InputRule, LabelRule, SizeBound, batch_rules

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import builder  # noqa: E402
from small_gpt import small_capture  # noqa: E402


def test_the_example_gpt_checks_its_targets_and_its_positions():
    rules = batch_rules(small_capture())  # vocabulary 64, block_size 16
    assert rules == BatchRules(
        inputs=(InputRule(position=0, name="idx", keyword=False, dtype=torch.int64, sizes=("batch", "seq")),
                InputRule(position=1, name="targets", keyword=False, dtype=torch.int64, sizes=("batch", "seq"))),
        labels=(LabelRule(position=1, vocabulary=64, ignore_index=-100,
                          loss="cross_entropy_loss in module '<root module>'"),),
        bounds=(SizeBound(symbol="seq", most=16,
                          reason="wpe.weight has 16 rows, read at arange(seq) by embedding_1 in module 'wpe'"),),
    )
    assert rules.inputs[1].label == "input 1 (targets)"


def test_the_vocabulary_is_the_global_one_under_tensor_parallelism():
    """The rules read the capture, before tp shards the head: the rank's logits have 32
    columns and its cross entropy is vocabulary-parallel, the labels still range over 64."""
    program = fxpar.compile(small_capture(), "tp=2")
    assert "localize_indices" in program.rank_module(1).code
    assert batch_rules(program.captured).labels[0].vocabulary == 64


def test_hugging_face_labels_are_traced_through_the_shift_and_the_padding():
    """GPT-2's loss pads the labels with -100, drops their first column, flattens and casts
    them (`pad -> slice -> contiguous -> reshape -> to`): the rule lands on `labels`. Its
    positions are `arange(past, past + seq)`, exported as `arange(seq) + 0`."""
    model, inputs = builder("gpt2")("sdpa")  # vocabulary 256, n_positions 64, keyword inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rules = batch_rules(fxpar.capture(model, inputs))
    assert [rule.label for rule in rules.inputs] == ["input_ids", "labels"]
    assert rules.labels == (LabelRule(position=1, vocabulary=256, ignore_index=-100,
                                      loss="cross_entropy_loss in module '<root module>'"),)
    assert rules.bounds == (SizeBound(symbol="seq", most=64, reason=(
        "transformer.wpe.weight has 64 rows, read at arange(seq) by embedding_1 in module 'transformer.wpe'")),)


class _Tagger(nn.Module):
    """Per-token classes from float features (a fixed last dim of 4), through log_softmax and
    nll_loss, its ignore index 7; `shift` makes the target `labels - 1` instead."""

    def __init__(self, shift: bool = False):
        super().__init__()
        self.head, self.shift = nn.Linear(4, 5), shift

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        scores = F.log_softmax(self.head(features), dim=-1).flatten(0, 1)
        target = labels - 1 if self.shift else labels
        return F.nll_loss(scores, target.flatten(), ignore_index=7)


def tagger_rules(shift: bool = False) -> BatchRules:
    example = {"features": torch.randn(4, 6, 4), "labels": torch.randint(0, 5, (4, 6))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return batch_rules(fxpar.capture(_Tagger(shift), example))


def test_nll_loss_gives_its_ignore_index_and_fixed_dims_their_size():
    rules = tagger_rules()
    assert rules.inputs[0] == InputRule(position=0, name="features", keyword=True, dtype=torch.float32,
                                        sizes=("batch", "seq", 4))
    assert [(r.position, r.vocabulary, r.ignore_index) for r in rules.labels] == [(1, 5, 7)]
    assert rules.bounds == ()  # no position table


def test_a_target_the_model_computes_gives_no_rule():
    """`labels - 1` is not the labels: which values are valid is the model's business, and
    torch's loss checks them as it always has."""
    assert tagger_rules(shift=True).labels == ()


class _SoftTargets(nn.Module):
    """Cross entropy against class probabilities: a float target, no class index to check."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 5)

    def forward(self, features: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(features), probabilities)


def test_class_probabilities_give_no_rule():
    example = (torch.randn(4, 4), torch.softmax(torch.randn(4, 5), dim=-1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert batch_rules(fxpar.capture(_SoftTargets(), example)).labels == ()
