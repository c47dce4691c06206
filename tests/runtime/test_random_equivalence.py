"""Dropout under fxpar: rng=exact trains exactly as one device, rng=fast draws consistently.

One launch of 4 gloo ranks (tests/workers/random_worker.py) trains the tiny GPT with dropout
0.1 (embedding, attention probabilities over tp-sharded heads, the MLP's output after the
row-parallel all-reduce), and Hugging Face's GPT-2 with its default dropouts (eager attention:
an aten.dropout on the probabilities of tp-sharded heads), for 3 AdamW steps under each plan,
every process having seeded its own generator differently before bind.

rng=exact is compared with one device: fxpar's program for one rank (plan "rng=exact"),
trained here by hand with the same seed, which draws each random value whole from the same
stream (`fxpar.ops.random_streams`). Tolerances as in the dropout-free tiers (fp32, rel 1e-5: the
same per-sample values summed in another order), gradients with a floor of 1e-6 x the largest
gradient norm for the key bias's exactly-zero true gradient, parameters compared all together
(tiny_training.OPTIMIZER says why).

rng=fast cannot equal one device (each rank draws only its piece); what it promises is
checked instead: masks equal across tp peers for a tp-replicated value and different for a
tp-sharded one, different across dp replicas and microbatches; tp-replicated parameters stay
bit-identical across tp ranks; the same seed reproduces the run bit for bit.
"""

import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.ops.random_streams import RandomStream, bind_random, unbind_random

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from random_worker import MODELS, STEPS, model_and_plan  # noqa: E402

pytestmark = pytest.mark.multirank
RELATIVE = 1e-5
EXACT = ("dp=2 tp=2 mb=2 rng=exact", "dp=2 pp=2 mb=2 rng=exact", "tp=2 sp=true pp=2 mb=2 rng=exact",
         "dp=2 tp=2 zero=3 mb=2 rng=exact", "hf-gpt2:dp=2 tp=2 rng=exact")
FAST = "dp=2 tp=2 mb=2"


def one_device(name: str) -> dict:
    """Plan "rng=exact" on one device, by hand: what Runner.step does with one rank."""
    build, batches, options = MODELS[name]
    model = build()
    program = fxpar.compile(model, "rng=exact", example_inputs=batches()[0])
    module, count = program.rank_module(0), program.loss_reduction.count_module
    optimizer = torch.optim.AdamW(module.parameters(), **options)
    stream = RandomStream(seed=0)  # rank 0's torch.manual_seed(0)
    bind_random(stream)
    losses, grads = [], None
    try:
        for tokens, labels in batches():
            loss = module(tokens, labels, count(tokens, labels).to(program.loss_reduction.count_dtype))
            loss.backward()
            losses.append(loss.item())
            if grads is None:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            stream.step += 1
    finally:
        unbind_random(stream)
    return {"losses": losses, "grads": grads, "state": model.state_dict()}


@pytest.fixture(scope="module")
def ranks(module_torchrun):
    return module_torchrun("random_worker.py", 4, *EXACT, FAST, FAST)


@pytest.fixture(scope="module")
def references():
    return {name: one_device(name) for name in MODELS}


@pytest.fixture(scope="module")
def reference(references):
    return references["gpt"]


@pytest.mark.parametrize("name", MODELS)
def test_dropout_is_active_in_the_reference(references, name):
    build, batches, _ = MODELS[name]
    model = build().eval()
    tokens, labels = batches()[0]
    assert abs(references[name]["losses"][0] - model(tokens, labels).item()) > 1e-4


@pytest.mark.parametrize("plan", EXACT)
def test_exact_trains_as_one_device(ranks, references, plan):
    reference = references[model_and_plan(plan)[0]]
    for results in ranks:
        result = results[plan]
        assert result["rng_state"] == {"seed": 0, "step": STEPS}  # rank 0's seed, on every rank
        for step, (loss, ref) in enumerate(zip(result["losses"], reference["losses"])):
            assert loss == pytest.approx(ref, rel=RELATIVE), f"loss of step {step}"
        ref_grads = reference["grads"]
        floor = 1e-6 * max(g.norm() for g in ref_grads.values())
        for name, grad in result["grads"].items():
            assert (grad - ref_grads[name]).norm() <= RELATIVE * ref_grads[name].norm() + floor, name
        state, ref_state = result["state"], reference["state"]
        difference = torch.cat([(state[k] - ref_state[k]).flatten() for k in ref_state])
        norm = torch.cat([v.flatten() for v in ref_state.values()])
        assert difference.norm() <= RELATIVE * norm.norm()


def peers(ranks, plan, same: str, differ: str):
    """Pairs of ranks' results with equal `same` coordinate and different `differ` one."""
    results = [r[plan] for r in ranks]
    return [(a, b) for i, a in enumerate(results) for b in results[i + 1:]
            if getattr(a["coord"], same) == getattr(b["coord"], same)
            and getattr(a["coord"], differ) != getattr(b["coord"], differ)]


def test_fast_masks_follow_placements(ranks):
    slices = ranks[0][FAST]["slices"]
    attention = [i for i, s in slices.items() if s.tp_dim == 1]
    replicated = [i for i, s in slices.items() if s.tp_dim == -1]
    assert attention and replicated
    for a, b in peers(ranks, FAST, same="dp", differ="tp"):  # tp peers
        for op in replicated:
            assert torch.equal(a["masks"][(op, 0)], b["masks"][(op, 0)]), f"draw {op} on tp peers"
        for op in attention:
            assert not torch.equal(a["masks"][(op, 0)], b["masks"][(op, 0)]), f"draw {op} on tp peers"
    for a, b in peers(ranks, FAST, same="tp", differ="dp"):  # dp replicas
        for op in slices:
            assert not torch.equal(a["masks"][(op, 0)], b["masks"][(op, 0)]), f"draw {op} on dp replicas"
    for result in (r[FAST] for r in ranks):
        for op in slices:
            assert not torch.equal(result["masks"][(op, 0)], result["masks"][(op, 1)]), f"draw {op}, microbatches"


def test_fast_keeps_replicated_parameters_equal_across_tp(ranks):
    pairs = peers(ranks, FAST, same="dp", differ="tp")
    assert pairs
    for a, b in pairs:
        assert "ln_f.weight" in a["replicated"]
        for name, value in a["replicated"].items():
            assert torch.equal(value, b["replicated"][name]), name


def test_fast_reproduces_with_the_same_seed_whatever_each_process_set(ranks, reference):
    for results in ranks:
        first, again = results[FAST], results[f"{FAST}#2"]
        assert first["losses"] == again["losses"]
        assert all(torch.equal(first["state"][k], again["state"][k]) for k in first["state"])
        # Dropout is on: the fast run is not the exact one's, which is one device's.
        assert first["losses"][0] != pytest.approx(reference["losses"][0], rel=1e-6)


def test_a_seed_given_to_bind_is_the_jobs_and_must_agree(ranks):
    for rank, results in enumerate(ranks):
        assert results["seed=5"] == {"seed": 5, "step": 0}
        message = results["seed=rank"]
        assert "different seeds on different ranks (from 0 to 3" in message
        assert f"this rank passed {rank}" in message and "Fix: pass the same seed on every rank" in message
