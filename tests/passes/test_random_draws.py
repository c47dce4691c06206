"""passes.random_draws: each random op of the captured graph becomes a draw of
fxpar.ops.random_ops, numbered in graph order, its slice read from its placements; what the pass
cannot draw by slice is refused; rng=exact's extra draws are priced."""

import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.errors import CaptureError
from fxpar.ops.random_ops import DrawSlice
from fxpar.ops.random_streams import RandomStream, bind_random, unbind_random

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import GPT, GPTConfig, global_batches  # noqa: E402

random_like = torch.ops.fxpar.random_like.default
attention_mask = torch.ops.fxpar.attention_dropout_mask.default
DROPOUT = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.1)


@pytest.fixture
def stream():
    stream = RandomStream(seed=7)
    bind_random(stream)
    yield stream
    unbind_random()


def draws(program, rank=0):
    """(distribution, op index, exact, slice) of every draw of the rank's modules, in order."""
    found = []
    for module in program.stage_modules(rank):
        for node in module.graph.nodes:
            if node.target in (random_like, attention_mask):
                distribution = node.args[1] if node.target is random_like else "attention"
                index, exact = node.args[3], node.args[4]
                found.append((distribution, index, exact, DrawSlice(*node.args[5:11])))
    return found


@pytest.fixture(scope="module")
def gpt_example():
    torch.manual_seed(0)
    tokens, labels = global_batches()[0]
    return fxpar.capture(GPT(DROPOUT), (tokens, labels))


def test_the_pass_reads_each_draws_slice_from_its_placement(gpt_example):
    program = fxpar.compile(gpt_example, "dp=2 tp=2 mb=2")
    found = draws(program)
    # Embedding dropout, then per block: attention probabilities, and the MLP's output (after
    # the row-parallel down projection's all-reduce: replicated on tp).
    assert [d for d, *_ in found] == ["dropout"] + ["attention", "dropout"] * 2
    assert [i for _, i, _, _ in found] == list(range(5))
    for distribution, _, exact, where in found:
        assert not exact and where.dp_dim == 0 and (where.dp_size, where.microbatches, where.tp_size) == (2, 2, 2)
        assert where.tp_dim == (1 if distribution == "attention" else -1)  # heads split; residual stream not
    code = program.rank_module(0).code
    assert "torch.ops.aten.dropout" not in code and "scaled_dot_product_attention.default" not in code


def test_sequence_parallel_dropout_is_split_on_the_sequence(gpt_example):
    found = draws(fxpar.compile(gpt_example, "tp=2 sp=true"))
    assert {where.tp_dim for d, _, _, where in found if d == "dropout"} == {1}


def test_pipeline_stages_number_their_draws_in_the_whole_graphs_order(gpt_example):
    program = fxpar.compile(gpt_example, "pp=2 mb=2 rng=exact")
    first, second = draws(program, 0), draws(program, 1)
    assert first and second and [i for _, i, _, _ in first + second] == list(range(5))
    assert all(exact for _, _, exact, _ in first + second)


def test_exact_is_priced_as_drawing_the_whole_value(gpt_example):
    fast = fxpar.compile(gpt_example, "dp=2 mb=2").estimate()
    exact = fxpar.compile(gpt_example, "dp=2 mb=2 rng=exact").estimate()
    assert not any("fxpar" in op for op in exact.uncosted)
    # The example batch (8, 16): three dropouts of (8, 16, 32) and two attention masks of
    # (8, 4, 16, 16), 28,672 values. Each of the 2 ranks x 2 microbatches draws all of them
    # instead of its quarter: 3 x 28,672 more draws, 2 FLOPs each.
    assert exact.flops["other"] - fast.flops["other"] == 2 * 3 * (3 * 8 * 16 * 32 + 2 * 8 * 4 * 16 * 16)
    assert exact.flops["matmul"] == fast.flops["matmul"]


def test_a_model_in_eval_mode_draws_nothing(gpt_example):
    torch.manual_seed(0)
    model = GPT(DROPOUT).eval()
    program = fxpar.compile(model, "dp=2", example_inputs=global_batches()[0])
    assert draws(program) == []


class NativeDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        out, kept = torch.native_dropout(self.linear(x), 0.5, True)
        return (out * kept + torch.rand_like(out)).sum()


def test_native_dropout_and_rand_like_draw_from_streams(stream):
    torch.manual_seed(0)
    model, x = NativeDropout(), torch.randn(4, 3, 4)
    with pytest.warns(UserWarning, match="averaged as means"):  # a sum, not a cross entropy
        program = fxpar.compile(model, "dp=2", example_inputs=(x,))
    assert [(d, i) for d, i, _, _ in draws(program)] == [("dropout", 0), ("uniform", 1)]
    module = fxpar.compile(model, "", example_inputs=(x,)).rank_module(0)
    loss = module(x)
    mask = random_like(x, "dropout", 0.5, 0, False, *DrawSlice(dp_dim=0).args)
    noise = random_like(x, "uniform", 0.0, 1, False, *DrawSlice(dp_dim=0).args)
    hidden = model.linear(x)
    torch.testing.assert_close(loss, (hidden * mask * (mask != 0) + noise).sum())
    loss.backward()
    assert model.linear.weight.grad is not None


class RandintModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.noise = torch.nn.Module()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return (self.linear(x) + torch.randint(0, 2, x.shape).float()).sum()


def test_a_random_op_fxpar_cannot_slice_is_refused_by_name():
    with pytest.raises(CaptureError, match=r"aten\.randint.*root module.*rand_like"):
        fxpar.compile(RandintModel(), "dp=2", example_inputs=(torch.randn(4, 3, 4),))



@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hugging_face_gpt2s_dropouts_are_drawn_by_placement(attention):
    """GPT-2's default dropouts (0.1 on embeddings, attention probabilities, both residual
    branches): with sdpa the probabilities' dropout is sdpa's dropout_p, with eager attention
    an aten.dropout; either way split over tp like the heads, the rest replicated on tp."""
    import transformers

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from hf_models import VOCAB, LossOf, _batch

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     use_cache=False, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                                     attn_implementation=attention)
    model = LossOf(transformers.AutoModelForCausalLM.from_config(config).train())
    batch = _batch()
    found = draws(fxpar.compile(model, "dp=2 tp=2", example_inputs=(batch["input_ids"], batch["labels"])))
    heads = "attention" if attention == "sdpa" else "dropout"
    assert [(d, where.tp_dim) for d, _, _, where in found] == [("dropout", -1)] + [
        (heads, 1), ("dropout", -1), ("dropout", -1)] * 2


class SizedDraws(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.linear(x)
        return torch.nn.functional.mse_loss(h * torch.rand(h.shape) + torch.randn(h.shape[0], 1, 4), y)


def test_rand_and_randn_of_a_size_draw_from_streams_without_tp(stream):
    torch.manual_seed(0)
    model, x, y = SizedDraws(), torch.randn(4, 3, 4), torch.randn(4, 3, 4)
    with pytest.warns(UserWarning, match="averaged as means"):
        found = draws(fxpar.compile(model, "dp=2", example_inputs=(x, y)))
    assert [(d, where.dp_dim) for d, _, _, where in found] == [("uniform", 0), ("normal", 0)]
    module = fxpar.compile(model, "", example_inputs=(x, y)).rank_module(0)
    uniform = random_like(x, "uniform", 0.0, 0, False, *DrawSlice(dp_dim=0).args)
    normal = random_like(torch.empty(4, 1, 4), "normal", 0.0, 1, False, *DrawSlice(dp_dim=0).args)
    torch.testing.assert_close(module(x, y), torch.nn.functional.mse_loss(model.linear(x) * uniform + normal, y))
    with pytest.raises(CaptureError, match=r"aten\.rand\.default in the root module.*without tensor parallelism"):
        fxpar.compile(model, "tp=2", example_inputs=(x, y))
