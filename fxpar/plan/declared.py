"""The tensor-parallel plans a Hugging Face model declares about itself.

transformers models carry their authors' tensor-parallel layout as data: the config's
`base_model_tp_plan` (keys relative to the base model, `model.model` of a `LlamaForCausalLM`:
`{"layers.*.self_attn.q_proj": "colwise", ...}`) and the model class's `_tp_plan` for its head
(`{"lm_head": "colwise_gather_output"}`). `capture` reads them once, with keys made relative to
the captured module, so a plan can say `tp_rules=auto` (the base plan, when there is one) or
`tp_rules=model` (both) without the model at hand. Pure: reads attributes only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DeclaredPlans:
    """Module-path glob -> transformers style, relative to the captured module."""

    base: Mapping[str, str] = field(default_factory=dict)  # the transformer layers' layout
    whole: Mapping[str, str] = field(default_factory=dict)  # base + the heads' (model level)


def declared_plans(model: torch.nn.Module) -> DeclaredPlans:
    """What `model`, and every Hugging Face model inside it (a loss wrapper's `self.model`),
    declares; empty for a model that declares nothing.

        declared_plans(LlamaForCausalLM(config)).whole
        -> {"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head": "colwise_gather_output"}
    """
    base: dict[str, str] = {}
    heads: dict[str, str] = {}
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if not hasattr(config, "base_model_tp_plan") or not hasattr(module, "base_model_prefix"):
            continue
        prefix = f"{path}." if path else ""
        base_name = module.base_model_prefix
        base_prefix = f"{prefix}{base_name}." if base_name and hasattr(module, base_name) else prefix
        base |= {base_prefix + key: style for key, style in (config.base_model_tp_plan or {}).items()}
        for plan in (getattr(type(module), "_tp_plan", None), getattr(module, "_tp_plan", None),
                     getattr(module, "tp_plan", None)):
            if isinstance(plan, Mapping):
                heads |= {prefix + key: style for key, style in plan.items()}
    return DeclaredPlans(base=base, whole=base | heads)
