"""A Llama-style decoder, written like nanoGPT: the second example transformer of fxpar.

Read top to bottom. Against the GPT of `gpt.py` it changes four things, each from its paper:

* RMSNorm instead of LayerNorm (Zhang & Sennrich 2019, "Root Mean Square Layer
  Normalization"): no mean subtraction, no bias;
* rotary position embeddings instead of a learned position table (Su et al. 2021,
  "RoFormer", Sec. 3.4), in the "rotate_half" form of Hugging Face's Llama;
* grouped-query attention (Ainslie et al. 2023, "GQA"): `n_kv_head` key/value heads, each
  shared by `n_head // n_kv_head` query heads;
* a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6):
  `down(silu(gate(x)) * up(x))`, no biases anywhere (Touvron et al. 2023, "LLaMA", Sec. 2.2).

Module names follow the tensor-parallel plans of `examples/` (fxpar shards by module path):

    embed_tokens
    layers.{i}.attention_norm
    layers.{i}.attention.{q_proj, k_proj, v_proj, o_proj}
    layers.{i}.ffn_norm
    layers.{i}.mlp.{gate_proj, up_proj, down_proj}
    norm
    lm_head                        (not tied to embed_tokens)

`forward(idx, targets)` returns the mean cross-entropy loss, the contract `fxpar.compile`
expects: `model(*inputs) -> scalar loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 32000  # Llama 1 and 2's SentencePiece vocabulary
    n_layer: int = 32
    n_head: int = 32  # query heads
    n_kv_head: int = 8  # key/value heads (grouped-query attention); n_head % n_kv_head == 0
    n_embd: int = 4096
    intermediate_size: int = 11008  # SwiGLU hidden width (about 8/3 * n_embd, rounded)
    max_seq_len: int = 2048  # longest sequence the rotary tables cover
    rope_theta: float = 10000.0  # RoFormer's base of the rotation frequencies
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}); "
                f"fix: pick n_embd = n_head * head_dim"
            )
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): "
                f"each key/value head serves n_head // n_kv_head query heads"
            )
        if (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(
                f"head_dim ({self.n_embd // self.n_head}) must be even: rotary embeddings "
                "rotate pairs of features"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019, eq. 4), computed in the input's dtype.

    Written out with torch ops rather than `F.rms_norm`, so the captured graph shows the
    pow / mean / add / rsqrt / mul chain that fxpar's propagation rules see.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (max_seq_len, head_dim).

    RoFormer eq. 15: position m rotates the feature pair i by the angle m * theta_i, with
    theta_i = rope_theta ** (-2i / head_dim). In the rotate_half form the pairs are
    (x[i], x[i + head_dim/2]), so the angles are laid out twice: [theta_0..theta_{d/2-1},
    theta_0..theta_{d/2-1}].
    """
    hs = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs))
    positions = torch.arange(config.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (max_seq_len, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (max_seq_len, hs)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the halves of the last dim: a 90-degree turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (B, nh, T, hs) by position; cos and sin are (T, hs) and broadcast over B, nh.

    We rotate after the transpose to (B, nh, T, hs), so the tables broadcast as they are,
    with no unsqueeze: the head dim (the one tensor parallelism splits) never meets them.
    """
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # batch, sequence, embedding
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # GQA: key/value head j serves query heads j*g .. j*g + g-1, so repeat each in place.
        groups = nh // nkv
        k = torch.repeat_interleave(k, groups, dim=1)  # (B, nh, T, hs)
        v = torch.repeat_interleave(v, groups, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # re-assemble the heads side by side
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020, eq. 6): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Derived from the config, not learned: kept out of the state_dict.
        cos, sin = rotary_tables(config)
        self.register_buffer("cos", cos, persistent=False)  # (max_seq_len, hs)
        self.register_buffer("sin", sin, persistent=False)  # (max_seq_len, hs)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        cos, sin = self.cos[:T], self.sin[:T]  # (T, hs)
        x = self.embed_tokens(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, self.config.vocab_size), targets.view(-1))
