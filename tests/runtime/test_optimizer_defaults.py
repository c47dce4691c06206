"""The options `runner.optimizer` passes to torch.optim: the user's as given, and on CUDA the
fused kernels of Adam, AdamW and SGD unless the user chose (`runtime.state.optimizer_defaults`).

The CUDA default is checked as the function that decides it (no GPU here); what reaches the
inner optimizer is checked on a bound world of one, on the CPU, whose fused AdamW torch has.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.runtime.state.optimizer_defaults import with_defaults

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_cuda_fuses_adam_adamw_and_sgd_by_default(optimizer_class):
    assert with_defaults(optimizer_class, {"lr": 0.1}, CUDA) == {"lr": 0.1, "fused": True}


@pytest.mark.parametrize(("optimizer_class", "options", "device"), [
    (torch.optim.AdamW, {"fused": False}, CUDA),  # the user's choice, either way
    (torch.optim.AdamW, {"foreach": True}, CUDA),  # fused and foreach exclude each other
    (torch.optim.Adagrad, {}, CUDA),  # no fused kernel in the default's list
    (torch.optim.AdamW, {}, CPU),  # torch's own default, as the one-device reference runs
])
def test_what_the_user_chose_and_other_devices_are_left_alone(optimizer_class, options, device):
    assert with_defaults(optimizer_class, options, device) == options


@pytest.mark.parametrize("plan", ["dp=1", "dp=1 precision=bf16-mixed"])
def test_fused_reaches_the_optimizer_that_steps_and_trains_as_the_for_loop(torchrun_world_of_one, plan):
    """`fused=True` reaches the torch optimizer that steps (under bf16-mixed the one over the
    fp32 masters); three steps of it equal the for-loop's to 1e-6 relative over all the
    parameters together (the two kernels round AdamW's arithmetic in different orders)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(3)]
    results = {}
    for fused in (True, False):
        runner = fxpar.compile(copy.deepcopy(model), plan, (batches[0], batches[0].clone())).bind(timeout=30)
        try:
            optimizer = runner.optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-6, fused=fused)
            assert getattr(optimizer, "optimizer", optimizer).defaults["fused"] is fused
            for tokens in batches:
                runner.step(tokens, tokens.clone())
                optimizer.step()
                optimizer.zero_grad()
            results[fused] = torch.cat([p.detach().float().flatten() for p in runner.module.parameters()])
        finally:
            runner.close()
    assert (results[True] - results[False]).norm() <= 1e-6 * results[False].norm()
