"""A nanoGPT-style GPT-2 model: the example transformer fxpar is developed against.

Read top to bottom, following Karpathy's nanoGPT `model.py`: token and learned position
embeddings, `n_layer` pre-norm blocks (causal self-attention with separate q/k/v
projections, then a GELU MLP), a final LayerNorm and a language-model head whose weight is
tied to the token embedding. `forward(idx, targets)` returns the mean cross-entropy loss,
which is the contract `fxpar.compile` expects: `model(*inputs) -> scalar loss`.

Nothing here knows about parallelism; fxpar rewrites the captured graph instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    block_size: int = 1024  # longest sequence the position embedding covers
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence, embedding
        hs = C // self.n_head
        q = self.q(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 n_layer) at init.
        for name, param in self.named_parameters():
            if name.endswith(("attn.o.weight", "mlp.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def factory(
    *,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    vocab_size: int = 256,
    seq: int = 128,
    batch: int = 16,
    device: str = "cpu",
) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """The example GPT and one global batch of random tokens: what the `fxpar` command line's
    `--model examples/gpt.py:factory` loads (`--config n_layer=48 device=meta` changes it).

    The default is `train_gpt.py`'s model (4 layers, 4 heads, width 128, bytes as tokens) at
    its batch of 16 x 128. `device="meta"` builds it without allocating any weight, enough
    for planning, checking, estimating and drawing at any size.
    """
    config = GPTConfig(block_size=seq, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    tokens = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (tokens, torch.roll(tokens, -1, dims=1))


def gpt3_175b() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """GPT-3 175B's shape (96 layers, 96 heads, width 12288, sequence 2048; Brown et al. 2020,
    Table 2.1; GPT-2's vocabulary padded to 50304) on the meta device, at a global batch of
    128 sequences: `fxpar explain --model examples/gpt.py:gpt3_175b --plan "dp=8 tp=8 pp=16 mb=16"`."""
    return factory(n_layer=96, n_head=96, n_embd=12288, vocab_size=50304, seq=2048, batch=128, device="meta")
