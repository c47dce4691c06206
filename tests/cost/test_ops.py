"""Tier 2: every op of a Hugging Face decoder has a compute rule; mask building costs bytes."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxpar
from fxpar.cost.ops import cost_of
from fxpar.frontend.trace import capture

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_models import BUILDERS, build  # noqa: E402


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_hf_model_has_no_uncosted_ops(name):
    pytest.importorskip("transformers")
    model, example_inputs = build(name, "sdpa")
    estimate = fxpar.compile(model, "dp=1", example_inputs=example_inputs).estimate("h100")
    assert estimate.uncosted == {}, f"{name}: ops with no rule in cost/ops.py: {estimate.uncosted}"
    assert "uncosted ops          none" in estimate.table()


class _CausalMask(nn.Module):
    """What transformers' `create_causal_mask` does to position ids, then a loss."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        starts = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1
        sequence = starts.cumsum(-1)  # packed-sequence index of each token
        q, kv = positions[:, :, None], positions[:, None, :]
        same = sequence[:, :, None] == sequence[:, None, :]
        mask = (kv <= q) & same
        scores = self.proj(x) @ x.transpose(-1, -2)
        return scores.masked_fill(~mask, 0.0).sum()


def test_mask_building_costs_bytes_and_no_flops():
    positions = torch.arange(8).repeat(2, 1)
    captured = capture(_CausalMask(), (positions, torch.randn(2, 8, 4)))
    masking = {"diff", "ne", "cumsum", "eq", "le", "__and__", "bitwise_not"}
    seen = set()
    for node in captured.graph_module.graph.nodes:
        cost = cost_of(node, captured.shape)
        if cost is None or node.target.overloadpacket.__name__ not in masking:
            continue
        seen.add(node.target.overloadpacket.__name__)
        assert cost.costed, f"{node.format_node()} has no rule"
        assert cost.matmul_flops == 0 and cost.other_flops == 0, f"{node.format_node()}: {cost}"
        assert cost.bytes != 0, f"{node.format_node()} moves no bytes"
    lost = masking - {"bitwise_not"} - seen  # `~mask` may be captured as logical_not
    assert not lost, f"the toy graph no longer has the mask ops {sorted(lost)}"
