"""A loss term of the batch's statistics (`passes.batch_statistics`) on a Hugging Face Mixtral.

With `output_router_logits=True`, Mixtral adds its routers' load-balancing loss to the cross
entropy: per layer, the rows each expert got (a histogram of the chosen experts) and the
routers' probabilities summed over the tokens, divided by the tokens' count, multiplied. Under
dp those four reductions are all-reduced in forward and the count is the global batch's; the
model's own token counts per expert (its experts' offsets) stay the rank's. Trained against
one device: tests/runtime/test_expert_parallel_equivalence.py (`*_aux`).
"""

from __future__ import annotations

import operator
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ops.expert_routing import is_grouped_mm

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_models import build  # noqa: E402

aten, fxpar_ops = torch.ops.aten, torch.ops.fxpar


@pytest.fixture(scope="module")
def captured():
    model, inputs = build("mixtral_aux")  # fresh: its first forward installs transformers' output hooks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxpar.capture(model, inputs)


def _all_reduced(graph) -> list:
    return [n.args[0] for n in graph.nodes if n.target is fxpar_ops.all_reduce.default and n.args[1] == "dp"]


def test_the_statistics_are_the_global_batchs_and_the_experts_counts_the_ranks(captured):
    program = fxpar.compile(captured, "dp=2 ep=2")
    graph = program.graph_module.graph
    assert meta.graph_loss(program.graph_module).statistics
    reduced = _all_reduced(graph)
    assert sorted(str(n.target) for n in reduced) == ["aten.histc.default"] * 2 + ["aten.sum.dim_IntList"] * 2
    # the experts' own histograms (their grouped matmuls' offsets) are not among them
    offsets = {m.args[2] for m in graph.nodes if is_grouped_mm(m)}
    assert offsets and not any(r in n.all_input_nodes for n in offsets for r in reduced)
    # the count divided by is the global batch's: the rank's count times dp
    assert [n.args[1] for n in graph.nodes if n.target is operator.mul and n.args[1] == 2]
    calls = [c for c in program.collectives(0) if c.tag == "dp all_reduce"]
    assert [(c.phase, c.numel) for c in calls] == [("forward", 4)] * 4  # 4 experts each; none in backward


def test_one_rank_adds_nothing(captured):
    program = fxpar.compile(captured, "dp=1")
    assert not _all_reduced(program.graph_module.graph)
    assert meta.graph_loss(program.graph_module).statistics


@pytest.mark.parametrize("plan, key", [("dp=2 mb=2", "mb=2"), ("pp=2 mb=2", "mb=2"), ("cp=2", "cp=2")])
def test_plans_that_split_the_batch_into_pieces_are_refused(captured, plan, key):
    with pytest.raises(PlanError, match=rf"plan {key}: the loss adds a term of the whole batch's statistics to "
                                        r"the cross entropy .*Fix: mb=1, pp=1 and cp=1"):
        fxpar.compile(captured, plan)


class RouterZLoss(torch.nn.Module):
    """Not a Hugging Face model: a router whose z-loss (ST-MoE, Zoph et al. 2022, eq. 5: the mean
    over the tokens of logsumexp(logits)^2) is added to a mean cross entropy, a mean the term
    takes over the whole batch (all-reduced, then divided by dp)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.router, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 64)

    def forward(self, ids, labels):
        hidden = self.embed(ids)
        logits = self.router(hidden)
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        gated = hidden * torch.softmax(logits, dim=-1).amax(dim=-1, keepdim=True)
        return torch.nn.functional.cross_entropy(self.head(gated).flatten(0, 1), labels.flatten()) + 0.1 * z_loss


@pytest.mark.multirank
def test_a_router_z_loss_is_one_devices_under_dp():
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[3, 2:] = -100  # the ranks' counts of valid targets differ
    report = fxpar.verify(RouterZLoss(), "dp=2", (ids, labels), timeout=30)
    assert report.equal, str(report)
    assert report.compared["parameter gradient"] == 5
