"""GPT-2 with Hugging Face's module names and its fused qkv projection, in plain nn.Linear.

The same network as `gpt.py` (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners"), laid out as `transformers.GPT2LMHeadModel` lays it out, so that
tensor-parallel plans written against Hugging Face's names apply here unchanged:

    transformer.wte, transformer.wpe, transformer.drop
    transformer.h.{i}.ln_1
    transformer.h.{i}.attn.c_attn        nn.Linear(C, 3C): q, k and v fused side by side
    transformer.h.{i}.attn.c_proj
    transformer.h.{i}.ln_2
    transformer.h.{i}.mlp.c_fc           C -> 4C
    transformer.h.{i}.mlp.c_proj         4C -> C
    transformer.ln_f
    lm_head                              tied to transformer.wte (Press & Wolf 2017)

Two differences from Hugging Face: projections are `nn.Linear` (weight (out, in)), not
GPT-2's `Conv1D` (weight (in, out)), so a checkpoint's c_attn/c_proj/c_fc weights load
transposed; and `forward(idx, targets)` returns only the mean cross-entropy loss, the
contract `fxpar.compile` expects: `model(*inputs) -> scalar loss`.

The fused c_attn is what makes this model interesting to fxpar: its output columns are
[q | k | v], so splitting them evenly across ranks would hand rank 0 all of q and part of k.
A column-parallel shard of c_attn must take each rank's heads out of each of the three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024  # longest sequence the position embedding covers
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.0  # Hugging Face's embd_pdrop, attn_pdrop and resid_pdrop in one

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}); "
                "fix: pick n_embd = n_head * head_dim"
            )


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # [q | k | v]
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, sequence, embedding
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.resid_dropout(self.c_proj(y))


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new": the tanh approximation of GELU (Hendrycks & Gimpel 2016, eq. 3).
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-5)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-5)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """The body: embeddings, blocks and the final LayerNorm (Hugging Face's `transformer`)."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([GPT2Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=1e-5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)  # (B, T, C)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init_weights)
        # GPT-2 Sec. 2.3: residual projections scaled by 1/sqrt(N) at init, N = 2 per block.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
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
        logits = self.lm_head(self.transformer(idx))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, self.config.vocab_size), targets.view(-1))
