"""Tier 1: Hugging Face models are captured as they are, with keyword inputs, and their mean
loss is compiled into a sum over the step's global count of valid targets. No processes."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.errors import CaptureError

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import BUILDERS  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    model, batch = BUILDERS["llama"]("sdpa")
    return model, batch, fxpar.capture(model, batch)


def test_a_model_output_is_reduced_to_its_loss(llama):
    model, batch, captured = llama
    assert captured.input_names == ("input_ids", "labels") and captured.keyword_inputs
    loss = captured.graph_module(*captured.arrange((), batch))
    assert torch.equal(loss, model(**batch).loss)  # the same kernels in the same order


def test_the_global_count_of_valid_targets_is_compiled_from_the_labels(llama):
    _, batch, captured = llama
    program = fxpar.compile(captured, "dp=2 mb=2")
    reduction = program.loss_reduction
    assert reduction.sums and program.input_names == ("input_ids", "labels", "valid_targets")
    shifted = batch["labels"][:, 1:]  # a causal LM predicts the next token: the last has none
    assert reduction.count_module(*captured.arrange((), batch)) == (shifted != -100).sum()
    count, *_ = program.collectives(0)
    # It rides in the first gradient bucket, as two digits, with a step slot per rank.
    assert (count.kind, count.agreement, count.group) == ("all_reduce", 2, (0, 1))
    assert program.step_program(0).count_slots() == 2
    assert count.tag.startswith("gradient bucket 0") and count.tag.endswith(" + valid targets + step")


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_no_model_is_refused_for_writing_state_in_train_mode(name):
    # Capture refuses a forward that writes buffers or parameters (fxpar.frontend.state_writes); the
    # transformers models, in train mode, write none (rotary tables and masks are only read).
    model, batch = BUILDERS[name]("sdpa")
    model.train()
    captured = fxpar.capture(model, batch)
    assert torch.equal(captured.graph_module(*captured.arrange((), batch)), model(**batch).loss)


def test_an_output_without_a_loss_names_its_type_and_the_fix():
    model, batch = BUILDERS["gpt2"]("sdpa")
    with pytest.raises(CaptureError, match=r"found a CausalLMOutputWithCrossAttentions with \['logits'\].*`labels`"):
        fxpar.capture(model, {"input_ids": batch["input_ids"]})


def test_an_unknown_keyword_names_the_forward_parameters():
    model, batch = BUILDERS["llama"]("sdpa")
    with pytest.raises(CaptureError, match=r"'label' is not a parameter of LlamaForCausalLM.forward, which takes input_ids, attention_mask"):
        fxpar.capture(model, {"input_ids": batch["input_ids"], "label": batch["labels"]})


def test_positional_labels_of_a_hugging_face_model_point_to_keyword_inputs():
    model, batch = BUILDERS["gpt2"]("sdpa")
    with pytest.raises(CaptureError, match=r"input 1 -> '\w+'.*example_inputs=\{'input_ids'"):
        fxpar.capture(model, (batch["input_ids"], batch["labels"]))


class _SquaredError(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, y):
        return F.mse_loss(self.proj(x), y)


def test_a_loss_of_another_form_is_averaged_per_piece_with_a_warning():
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match="the loss is computed by mse_loss.*averaged as means"):
        program = fxpar.compile(_SquaredError(), "dp=2", example_inputs=(x, x))
    assert not program.loss_reduction.sums and program.input_names == ("x", "y")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxpar.compile(_SquaredError(), "dp=1", example_inputs=(x, x))  # nothing is split
