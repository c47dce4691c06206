"""A tiny GPT whose attention is written out (QK^T, scale, causal mask, softmax, dropout,
attention over V) instead of `scaled_dot_product_attention`, with dropout on: the model the
selective-checkpointing tests recompute the explicit core of, and on which recomputation must
replay dropout's masks. Its layers sit in `blocks`, an nn.ModuleList; `Flat` has none."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, LAYERS, MAX_SEQ, DROPOUT = 64, 32, 4, 2, 32, 0.1


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.attn_dropout = nn.Dropout(DROPOUT)
        self.register_buffer("mask", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(h // HEADS)
        scores = scores.masked_fill(~self.mask[:s, :s], float("-inf"))
        probs = self.attn_dropout(F.softmax(scores, dim=-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln_2, self.fc, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.out(F.gelu(self.fc(self.ln_2(x)))))


class ExplicitAttentionGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(MAX_SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class Flat(nn.Module):
    """No block list: an embedding and two named linears."""

    def __init__(self):
        super().__init__()
        self.wte, self.fc, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, targets):
        logits = self.head(F.gelu(self.fc(self.wte(idx))))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
