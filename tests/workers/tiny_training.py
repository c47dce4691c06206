"""The training both sides of an equivalence test run: a tiny GPT, fixed data, AdamW.

Imported by the test process (single-device reference) and by the torchrun workers (fxpar),
so both draw the same initial weights and the same global batches.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402
from gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

CONFIG = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
# The three model families tensor parallelism is tested on: separate q/k/v; GPT-2's fused
# c_attn; Llama's RMSNorm, rotary embeddings, grouped-query attention (4 query heads sharing
# 4 key/value heads), SwiGLU and an untied head.
MODELS = {
    "gpt": lambda: GPT(CONFIG),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)),
    "llama": lambda: Llama(LlamaConfig(vocab_size=64, n_layer=2, n_head=8, n_kv_head=4, n_embd=64,
                                      intermediate_size=128, max_seq_len=32)),
}


class NoGradRouter(torch.nn.Module):
    """Two experts, each token sent to one by a router that chooses under torch.no_grad() (the
    choice needs no gradient; the chosen expert's softmax weight, computed outside the block,
    carries the router's), as some mixture-of-experts routers do. `bias_of_choice` is read only
    inside the block: on one device it never gets a gradient, and AdamW leaves it as it was,
    weight decay included."""

    def __init__(self, vocab: int = 64, dim: int = 32, experts: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.bias_of_choice = torch.nn.Linear(dim, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        logits = self.router(h)
        with torch.no_grad():
            choice = (logits + self.bias_of_choice(h)).argmax(-1, keepdim=True)
        weight = logits.softmax(-1).gather(-1, choice)
        chosen = torch.nn.functional.one_hot(choice.squeeze(-1), len(self.experts)).to(h.dtype)
        h = h + weight * sum(chosen[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS["router"] = NoGradRouter


def _mixtral() -> torch.nn.Module:
    """A Hugging Face Mixtral, four experts and two per token (what `ep` splits), taking
    `(tokens, labels)` and returning its loss (tests/hf_models.LossOf)."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_models import LossOf

    config = transformers.MixtralConfig(
        vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, use_cache=False, attn_implementation="sdpa")
    return LossOf(transformers.MixtralForCausalLM(config).train())


MODELS["mixtral"] = _mixtral
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 5
# AdamW with eps=1e-6, not 1e-8: the key bias under softmax has an exactly-zero true gradient
# that is float noise in practice, and a tiny eps turns that noise into full-size updates of
# arbitrary sign, so two correct implementations would drift apart for no real reason.
OPTIMIZER = dict(lr=1e-2, eps=1e-6, weight_decay=0.1)
LR_DECAY = 0.5  # a scheduled run's learning rate, each step's half the last's (StepLR)


def lr_scheduler(optimizer):
    """The schedule of a scheduled run (`LR_DECAY`), stepped after each optimizer step."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=LR_DECAY)


def parameter_groups(model: torch.nn.Module) -> list[dict]:
    """nanoGPT's groups (matrices decayed, biases and norm weights not), the second also at a
    tenth of the learning rate so that its options change the training well beyond any
    tolerance here (test_parameter_groups)."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0,
             "lr": OPTIMIZER["lr"] / 10}]


MUON = dict(lr=2e-2)  # torch.optim.Muon's defaults otherwise: momentum 0.95, Nesterov, weight decay 0.1


def muon_and_adamw(model: torch.nn.Module) -> tuple[list, list]:
    """torch.optim.Muon's advice: Muon for the hidden matrices; AdamW for the embeddings (the
    GPT's head is its tied embedding) and every vector."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = [p for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings]
    return matrices, [p for p in model.parameters() if p.dim() != 2 or id(p) in embeddings]


class Optimizers(list):
    """Several optimizers over disjoint parameters, stepped as one."""

    def step(self) -> None:
        for optimizer in self:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self:
            optimizer.zero_grad()

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self for p, s in optimizer.state.items()}

    def state_dict(self) -> list[dict]:
        return [optimizer.state_dict() for optimizer in self]


def full_optimizer_state(runner, optimizer):
    """`runner.full_optimizer_state_dict` of the optimizer, or a list of each one's."""
    if isinstance(optimizer, Optimizers):
        return [runner.full_optimizer_state_dict(each) for each in optimizer]
    return runner.full_optimizer_state_dict(optimizer)


def build_model(name: str = "gpt", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


_CAPTURES: dict[str, tuple] = {}


def fresh_capture(name: str, example_inputs: tuple | dict, build=None) -> tuple:
    """`build_model(name)` (or `build()`) and its capture, (model, CapturedGraph), captured once
    per process: each later call puts the weights back as the build made them, so a worker's
    plans all start alike and pay torch.export once (most of a tiny plan's compile), not once
    per plan. Close each plan's runner before the next binds the same parameters."""
    import fxpar

    if name not in _CAPTURES:
        model = build() if build is not None else build_model(name)
        random_state = torch.random.get_rng_state()  # as build_model leaves it: bind draws the seed
        captured = fxpar.capture(model, example_inputs)
        tensors = {id(t): t for m in (model, captured.graph_module)
                   for t in (*m.parameters(), *m.buffers(), *vars(m).get("_tensor_constants", {}).values())}
        _CAPTURES[name] = (model, captured, [(t, t.detach().clone()) for t in tensors.values()], random_state)
    model, captured, initial, random_state = _CAPTURES[name]
    torch.random.set_rng_state(random_state)
    # New storage, same tensors, the model's and the capture's: a runner may have left a
    # parameter a view into its flat buffer (ZeRO) or cast in place, and the memory meter
    # counts storages. Tied weights are one tensor.
    for tensor, value in initial:
        tensor.data = value.clone()
        tensor.grad = None
    return model, captured


def computed_on_rank_0(compute):
    """`compute()` on rank 0, sent to every rank: for numbers every rank would compute alike
    (a program's estimate), which several ranks computing at once on CI's two cores made a
    third of a launch."""
    shared = [compute() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def global_batches(seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (GLOBAL_BATCH, SEQ)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
            torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
        )
        for _ in range(STEPS)
    ]


def backward_in_parts(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, parts: int) -> float:
    """Backward of each of `parts` equal parts of the batch, its mean loss / parts (the
    gradients accumulate); returns the batch's loss, the sum."""
    loss = 0.0
    for part, targets in zip(tokens.tensor_split(parts), labels.tensor_split(parts)):
        part_loss = model(part, targets) / parts
        part_loss.backward()
        loss += part_loss.item()
    return loss


def train_single_device(name: str = "gpt", *, scheduled: bool = False, clip: float | None = None,
                        grouped: bool = False, muon: bool = False, split: int = 1) -> dict:
    """Losses per step, gradients of step 1 and the final state of plain one-device training
    (`scheduled`: under `lr_scheduler`; `clip`: the gradients clipped to that global 2-norm before
    each step, "norms" has each step's inf-norm and 2-norm before clipping; `grouped`: AdamW over
    `parameter_groups`, "optimizer_state_dict" its state dict; `muon`: Muon and AdamW over
    `muon_and_adamw`'s parameters; `split`: each step's gradient summed over that many equal
    parts of the batch, each part's mean loss / split)."""
    model = build_model(name)
    if muon:
        matrices, rest = muon_and_adamw(model)
        optimizer = Optimizers([torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **OPTIMIZER)])
    else:
        optimizer = torch.optim.AdamW(parameter_groups(model) if grouped else model.parameters(), **OPTIMIZER)
    scheduler = lr_scheduler(optimizer) if scheduled else None
    losses, first_grads, norms = [], None, []
    for tokens, labels in global_batches():
        losses.append(backward_in_parts(model, tokens, labels, split))
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if clip is not None:  # the inf-norm first: a bound of inf leaves the gradients as they are
            norms.append((float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, math.inf)),
                          float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {names[id(p)]: {k: v.clone() for k, v in state.items()} for p, state in optimizer.state.items()}
    return {"losses": losses, "grads": first_grads, "state": model.state_dict(), "optimizer": moments,
            "norms": norms, "optimizer_state_dict": optimizer.state_dict()}


def train_single_device_bf16(name: str = "gpt", microbatches: int = 1) -> dict:
    """bf16 mixed precision written out in plain PyTorch, the arithmetic fxpar's
    `precision=bf16-mixed` is meant to do: bf16 weights (buffers as they are: Llama's fp32
    rotary tables make its q and k fp32, and attention reads bf16 copies of them, as matmuls
    do under autocast), fp32 master weights stepped by AdamW, the cross entropy on fp32
    logits, and the microbatches' gradients accumulated in bf16 (each microbatch's mean loss /
    microbatches, a power of two here, so the same gradient as a sum over the global count)."""
    model, masters, optimizer = _bf16_model(name)
    losses = []
    with _bf16_compute():
        for tokens, labels in global_batches():
            losses.append(backward_in_parts(model, tokens, labels, microbatches))
            for master, parameter in zip(masters, model.parameters()):
                master.grad, parameter.grad = parameter.grad.float(), None
            _step_masters(optimizer, masters, model)
    return _bf16_result(model, masters, optimizer, losses=losses)


def train_data_parallel_bf16(name: str = "gpt", *, ranks: int = 2, microbatches: int = 1,
                             reduce_dtype: torch.dtype = torch.float32) -> dict:
    """`train_single_device_bf16`'s arithmetic as `ranks` data-parallel ranks do it: each
    rank's contiguous share of the batch, cut in `microbatches`; each microbatch's bf16
    gradients (its mean loss / (ranks x microbatches), a power of two here) summed over the
    ranks in `reduce_dtype` (fp32: each rank's bf16 gradient cast up, then added), the sums
    accumulated over the microbatches in `reduce_dtype`, the fp32 masters stepped by AdamW.
    Also returns the first step's fp32 gradients ("grads")."""
    model, masters, optimizer = _bf16_model(name)
    losses, first_grads = [], None
    with _bf16_compute():
        for tokens, labels in global_batches():
            shares = list(zip(tokens.tensor_split(ranks), labels.tensor_split(ranks)))
            chunks = [list(zip(t.tensor_split(microbatches), y.tensor_split(microbatches))) for t, y in shares]
            accumulated, step_loss = None, 0.0
            for m in range(microbatches):
                reduced = None
                for r in range(ranks):
                    loss = model(*chunks[r][m]) / (ranks * microbatches)
                    loss.backward()
                    step_loss += loss.item()
                    grads = [p.grad.to(reduce_dtype) for p in model.parameters()]
                    model.zero_grad(set_to_none=True)
                    reduced = grads if reduced is None else [a + g for a, g in zip(reduced, grads)]
                accumulated = reduced if accumulated is None else [a + g for a, g in zip(accumulated, reduced)]
            losses.append(step_loss)
            for master, grad in zip(masters, accumulated):
                master.grad = grad.float()
            if first_grads is None:
                first_grads = {n: m.grad.clone() for (n, _), m in zip(model.named_parameters(), masters)}
            _step_masters(optimizer, masters, model)
    return _bf16_result(model, masters, optimizer, losses=losses, grads=first_grads)


def _bf16_model(name: str):
    """The model with bf16 parameters, their fp32 masters, and AdamW over the masters."""
    model = build_model(name)
    masters = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.bfloat16()
    return model, masters, torch.optim.AdamW(masters, **OPTIMIZER)


@contextlib.contextmanager
def _bf16_compute():
    """What bf16-mixed computes in, patched into torch.nn.functional: the cross entropy on
    fp32 logits, attention on bf16 copies of q, k and v (module doc of the callers)."""
    functional = torch.nn.functional
    cross_entropy, attention = functional.cross_entropy, functional.scaled_dot_product_attention
    try:
        functional.cross_entropy = lambda logits, *a, **k: cross_entropy(logits.float(), *a, **k)
        functional.scaled_dot_product_attention = lambda *qkv, **k: attention(*(t.bfloat16() for t in qkv), **k)
        yield
    finally:
        functional.cross_entropy, functional.scaled_dot_product_attention = cross_entropy, attention


def _step_masters(optimizer, masters, model) -> None:
    """AdamW on the fp32 masters, then each bf16 weight the master rounded."""
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for master, parameter in zip(masters, model.parameters()):
            parameter.copy_(master)


def _bf16_result(model, masters, optimizer, **results) -> dict:
    """`results` with the state (the masters under the parameters' names) and the moments."""
    names = dict(zip(map(id, masters), (n for n, _ in model.named_parameters())))
    moments = {names[id(p)]: {k: v.clone() for k, v in state.items()} for p, state in optimizer.state.items()}
    return results | {"state": model.state_dict() | {names[id(m)]: m for m in masters}, "optimizer": moments}
