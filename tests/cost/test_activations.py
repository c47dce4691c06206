"""Tier 2: the symbolic activation formula equals what a real forward saves, at any size."""

import sys
from pathlib import Path

import pytest
import torch

from fxpar.cost.activations import saved_activation_bytes
from fxpar.frontend.trace import capture
from fxpar.ir.symbols import BATCH, SEQ

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def bytes_saved_by_a_real_forward(model, tokens) -> int:
    """Distinct non-parameter storages autograd packs during one eager forward.

    Targets are a copy of the tokens: `capture` clones an input passed twice, so the formula
    counts the embedding's indices and the loss's targets as two storages, as they are in
    training (one tensor passed as both would be saved once).
    """
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(tokens, tokens.clone())
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}
    for t in saved:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("config", [
    GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=128, block_size=64),
    GPTConfig(n_layer=3, n_embd=48, n_head=6, vocab_size=96, block_size=64, bias=False),
])
def test_formula_equals_real_saved_bytes(config):
    torch.manual_seed(0)
    model = GPT(config)
    formula = saved_activation_bytes(capture(model, (torch.randint(0, 96, (4, 16)),) * 2))
    assert formula.free_symbols == {BATCH, SEQ}
    for batch, seq in [(2, 8), (4, 16), (3, 64)]:
        tokens = torch.randint(0, 96, (batch, seq))
        assert formula.subs({BATCH: batch, SEQ: seq}) == bytes_saved_by_a_real_forward(model, tokens)


@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_the_pipeline_cut_balances_the_activations_the_estimate_counts(checkpoint):
    """One activation model: the bytes the pipeline cut charges to the nodes of a stage
    (`compiler.pipeline_program.node_memory`) sum, over the whole graph, to the estimate's
    saved activations at the same microbatch, under checkpointing too. (The proxy it had of its
    own, the nodes' output sizes, summed to 2.5x these bytes here, and 12x under full
    checkpointing, which it ignored.)"""
    from fxpar.compiler.pipeline_program import node_memory
    from fxpar.plan.plan import Plan

    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=128, block_size=64))
    tokens = torch.randint(0, 128, (4, 16))
    captured = capture(model, (tokens, tokens.clone()))
    memory = node_memory(captured, microbatch=2, plan=Plan(pp=2, microbatches=2, checkpoint=checkpoint))
    charged = sum(memory(n)[1] for n in captured.graph_module.graph.nodes)
    sizes = {BATCH: 2, SEQ: 16}
    assert charged == float(saved_activation_bytes(captured, checkpoint=checkpoint).subs(sizes)) > 0


def _state_on(module: torch.fx.GraphModule, device: str, *, requires_grad: bool) -> torch.fx.GraphModule:
    """A copy of `module` whose parameters and buffers are fake tensors on `device`, and whose
    graph constants are placed there, as `bind` leaves a rank's module on a GPU."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxpar.runtime.binding import place_graph_constants

    module = copy.deepcopy(module)
    with FakeTensorMode():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            owner._parameters.pop(attribute, None)
            owner._buffers.pop(attribute, None)
            fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            setattr(owner, attribute, fake.requires_grad_(requires_grad and tensor.requires_grad))
    place_graph_constants(module, torch.device(device))
    module.recompile()
    return module


def test_a_rank_bound_to_a_gpu_is_estimated_on_the_capture_device():
    """The estimate's fake forward builds its state from the rank's module, which `bind` has
    moved to the rank's device, and its inputs from the capture's example values. On an H200
    the GPU tier died here: "Unhandled FakeTensor Device Propagation for aten.embedding.default,
    found two different devices cuda:0, cpu". Fake tensors carry a CUDA device on this CPU-only
    machine, so the bound state is faked, first without gradients (mixing devices raises at the
    embedding), then with them (autograd cannot record fake CUDA tensors without CUDA: the old
    code aborted the process there). The bytes equal those of the module left on the CPU."""
    import fxpar
    from fxpar.cost.activations import module_activation_bytes

    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=128, block_size=64))
    tokens = torch.randint(0, 128, (4, 16))
    program = fxpar.compile(model, "dp=1", (tokens, tokens.clone()))
    (module,) = program.stage_modules(0)
    given = set(program.input_names)
    on_cpu = module_activation_bytes(module, program.captured, given)
    without_grads = module_activation_bytes(_state_on(module, "cuda", requires_grad=False), program.captured, given)
    assert without_grads <= on_cpu  # nothing needs a gradient but the loss's inputs' path
    assert module_activation_bytes(_state_on(module, "cuda", requires_grad=True), program.captured, given) == on_cpu
