"""Small random-weight Hugging Face models for tests and benchmarks; nothing is downloaded.

`BUILDERS` maps a name to a builder `(attn_implementation) -> (model, inputs)`: the
transformers model, built from a config, and one batch as the keyword arguments it takes,

    model, inputs = BUILDERS["llama"]("sdpa")
    loss = model(**inputs).loss                  # inputs: input_ids (8, 16), labels (8, 16)

Every batch is 8 rows of 16 tokens. Row r's last r labels are -100 (ignored by the loss), so
each row has a different number of counted tokens; BERT's inputs carry its pad token there.
Dropout is off, so two forwards of one model give the same loss.

fxpar takes `model(*inputs) -> loss`, so for now `build(name)` wraps the model in `LossOf`
and returns positional inputs `(input_ids, labels)`:

    model, example_inputs = build("llama")
    program = fxpar.compile(model, "dp=2", example_inputs)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

BATCH, SEQ, VOCAB = 8, 16, 256
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, use_cache=False)


class LossOf(nn.Module):
    """`forward(input_ids, labels) -> loss` around a transformers model that takes keywords."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def _batch(*, pad_token: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids and labels, (BATCH, SEQ); row r ends with r ignored labels (and pad tokens)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    labels = input_ids.clone()
    for row in range(1, BATCH):
        labels[row, SEQ - row:] = -100
        if pad_token is not None:
            input_ids[row, SEQ - row:] = pad_token
    return {"input_ids": input_ids, "labels": labels}


def _causal(config_class: str, **config) -> Callable[[str], tuple[nn.Module, dict]]:
    def build(attn_implementation: str = "sdpa") -> tuple[nn.Module, dict]:
        import transformers

        torch.manual_seed(0)
        settings = {**config, "attn_implementation": attn_implementation}
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, config_class)(**settings)
        )
        return model.train(), _batch()

    return build


def _bert(attn_implementation: str = "sdpa") -> tuple[nn.Module, dict]:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        **{k: v for k, v in _SMALL.items() if k != "use_cache"}, max_position_embeddings=64,
        pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=attn_implementation,
    )
    model = transformers.BertForMaskedLM(config)
    return model.train(), _batch(pad_token=config.pad_token_id)


_DECODER = {**_SMALL, "num_key_value_heads": 2}  # grouped-query attention
BUILDERS: dict[str, Callable[[str], tuple[nn.Module, dict]]] = {
    "gpt2": _causal("GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                    bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1),  # 50256 is out of range
    "llama": _causal("LlamaConfig", **_DECODER),
    "mistral": _causal("MistralConfig", **_DECODER, sliding_window=8),  # window < seq: masked
    "qwen2": _causal("Qwen2Config", **_DECODER),
    "gpt_neox": _causal("GPTNeoXConfig", **_SMALL, hidden_dropout=0.0, attention_dropout=0.0),
    "bert": _bert,
    # Phi-3 fuses gate|up into one projection that it chunks, and q|k|v into one it slices
    # unevenly (grouped-query); GPT-J and Cohere rotate interleaved pairs, stacking them back.
    "phi3": _causal("Phi3Config", **_DECODER, pad_token_id=0),
    "gptj": _causal("GPTJConfig", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                    rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                    bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1),
    "cohere": _causal("CohereConfig", **_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


# More architectures, for `tests/hf_survey.py` (not the suite): each under a plan against one
# device, the way a new model family is checked before it joins BUILDERS. Gemma 2 and Bloom
# take eager attention only.
SURVEY: dict[str, Callable[[str], tuple[nn.Module, dict]]] = {
    "gemma": _causal("GemmaConfig", **_DECODER, head_dim=16),
    "gemma2": _causal("Gemma2Config", **_DECODER, head_dim=16, sliding_window=8),
    "gemma3": _causal("Gemma3TextConfig", **_DECODER, head_dim=16, sliding_window=8),
    "qwen3": _causal("Qwen3Config", **_DECODER, head_dim=16),
    "olmo2": _causal("Olmo2Config", **_DECODER),
    "opt": _causal("OPTConfig", vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                   num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=64,
                   dropout=0.0, attention_dropout=0.0, use_cache=False, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2),
    "falcon": _causal("FalconConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                      hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
                      bos_token_id=1, eos_token_id=2),
    "starcoder2": _causal("Starcoder2Config", **_DECODER, residual_dropout=0.0, embedding_dropout=0.0,
                          bos_token_id=1, eos_token_id=2),
    "granite": _causal("GraniteConfig", **_DECODER),
    "gpt_bigcode": _causal("GPTBigCodeConfig", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                           n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           use_cache=False, multi_query=True, bos_token_id=1, eos_token_id=2),
    "mixtral": _causal("MixtralConfig", **_DECODER, num_local_experts=4, num_experts_per_tok=2),
    # Its declared plan names dense-MLP modules an all-expert configuration lacks (skipped).
    "qwen3_moe": _causal("Qwen3MoeConfig", **_DECODER, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32),
    "smollm3": _causal("SmolLM3Config", **_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "qwen2_moe": _causal("Qwen2MoeConfig", **_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64),
    "olmoe": _causal("OlmoeConfig", **_DECODER, num_experts=4, num_experts_per_tok=2),
    # The routers' load-balancing loss added to the cross entropy (a product of the batch's
    # means), weighed 1, not 0.01-0.02 as in training, so that a rank's own statistics (0.1%
    # off here) would show far beyond the tests' 1e-5
    "mixtral_aux": _causal("MixtralConfig", **_DECODER, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=1.0),
    "qwen2_moe_aux": _causal("Qwen2MoeConfig", **_DECODER, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=64,
                             output_router_logits=True, router_aux_loss_coef=1.0),
    # Multi-head latent attention (keys filled slice by slice into an empty tensor), a dense
    # first layer, then routed and shared experts.
    "deepseek_v3": _causal("DeepseekV3Config", **_SMALL, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                           q_lora_rank=32),
    # Rotary positions in complex numbers, a shared expert beside the routed ones, every layer MoE.
    "llama4": _causal("Llama4TextConfig", **_DECODER, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                      intermediate_size_mlp=128, interleave_moe_layer_step=1, attention_chunk_size=64,
                      no_rope_layers=[1, 1]),
    # No attention (eager only, as transformers has it): tp=2 splits its embedding alone.
    "mamba": _causal("MambaConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8,
                     use_cache=False),
    "bloom": _causal("BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                     hidden_dropout=0.0, attention_dropout=0.0, use_cache=False),
}


def builder(name: str) -> Callable[[str], tuple[nn.Module, dict]]:
    """The builder of a model of BUILDERS or SURVEY."""
    return BUILDERS[name] if name in BUILDERS else SURVEY[name]


def build(
    name: str, attn_implementation: str = "sdpa"
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A model of BUILDERS or SURVEY as fxpar takes it today: `LossOf(model)` and
    `(input_ids, labels)`."""
    model, inputs = builder(name)(attn_implementation)
    return LossOf(model), (inputs["input_ids"], inputs["labels"])


# What the equivalence tests train: a few steps of AdamW on different batches. eps 1e-6, not
# 1e-8, for the reason in workers/tiny_training.OPTIMIZER. lr 1e-3, not the tiny GPT's 1e-2:
# Adam moves every element by about lr whatever its gradient's size, so an element whose
# gradient is near float noise (Qwen2's key biases, tokens the batch barely uses) moves by up to
# lr in a direction set by rounding; at 1e-2 that alone put tp=2 Qwen2 1.5e-5 (relative) from
# one device after 3 steps, at 1e-3 it is 5e-7. A real error still moves whole tensors by ~lr
# per element, orders of magnitude above the 1e-5 bound.
STEPS = 3
OPTIMIZER = dict(lr=1e-3, eps=1e-6, weight_decay=0.1)
MODELS_WITH_TP_PLAN = ("llama", "mistral", "qwen2", "gpt_neox")  # they declare their own


def batches(name: str, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """`steps` batches for model `name`, as keyword inputs, padded as `_batch` describes."""
    pad_token = 0 if name == "bert" else None
    return [_batch(pad_token=pad_token, seed=step + 1) for step in range(steps)]
