"""Tensor-parallel plan rules: which parameters are split, and how, from module paths.

A rule maps a module-path glob to a style (Shoeybi et al. 2019, Sec. 3). A style acts on the
ops of the module it names, the projections of `projections` (whatever their form: linear,
GPT-2's Conv1D addmm, mm, matmul) and embedding lookups, and through them on the parameters:

    style                  projection weight    projection bias   embedding (vocab, dim)
    colwise                Shard(out_dim)       Shard(0)          Shard(1): split the dim
    rowwise                Shard(in_dim)        Replicate         Shard(0): split the vocab
    vocab                  Shard(out_dim)       Shard(0)          Shard(0): split the vocab
    colwise_gather_output  colwise, and the op's output all-gathered where it is produced
    packed_colwise         Shard(out_dim, parts=k): k fused blocks, as the graph splits the
                           output, else 2 (transformers' split_factor: gate|up)
    packed_rowwise         Shard(in_dim, parts=2)
    replicate              Replicate            Replicate         Replicate

(`out_dim` is 0 for a linear's (out, in) weight and 1 for an (in, out) one; a mixture of
experts' 3D weights, `(experts, out, in)` as transformers stores them, are split the same way
behind their experts' dim: colwise `Shard(1)`, rowwise `Shard(2)`, each expert on every rank
in its slice, Megatron-Core's expert tensor parallelism.) A fused q|k|v
projection whose output the graph splits into k equal blocks gets `parts=k` under colwise too,
and one it slices into unequal blocks (Phi-3's grouped-query q|k|v) their relative widths,
`parts=(2, 1, 1)` (`projections.fused_projections`).

    Plan(tp=2, tp_rules={"h.*.attn.[qkv]": "colwise", "h.*.attn.o": "rowwise"})

A rule may also name a parameter (`"layers.*.experts.gate_up_proj"`) instead of a module; keys
also match a path's tail, so a plan relative to a base model fits the wrapped model too. A
module no rule matches is replicated; a module a rule names is never silently replicated:
if tensor parallelism cannot place one of its parameters, that is a PlanError naming it. A
tied parameter takes the layout all its uses agree on (a tied head and embedding both split
the vocabulary), and uses that disagree are a PlanError.

Hugging Face plans are accepted as they are: `HF_STYLES` maps every style transformers 5
registers (and the 4.x names) onto these; `fxpar.plan.declared` reads a model's own plans,
which `compile` uses for `tp_rules="auto"` (the base model's) and `"model"` (the whole).
Styles fxpar cannot honour (mixture-of-experts, latent attention) are PlanErrors with a fix.

`"infer"` (and `"auto"` for a model that declares no plan) infers Megatron's layout from the
graph instead (`inference.infer_styles`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import meta
from fxpar.ir.placement import R, Placement, Shard
from fxpar.passes.tensor_parallel.inference import infer_styles
from fxpar.passes.tensor_parallel.projections import fused_projections, grouped_projection_of, packet, projection_of

__all__ = [
    "HF_STYLES", "STYLES", "ParameterPlacements", "Use", "fused_projections",
    "infer_styles", "parameter_placements", "parameter_roles", "parameter_uses", "placement_for",
    "rules_matching_nothing",
]

Style = str
STYLES = ("colwise", "rowwise", "vocab", "replicate", "colwise_gather_output", "packed_colwise",
          "packed_rowwise")
_ROWWISE = {"rowwise", "packed_rowwise"}
# (out_dim, in_dim) of a projection's weight, by the kind of its use: a linear's (out, in), a
# matmul's (in, out), and a mixture of experts' 3D weights, (experts, out, in) as transformers
# stores them (transposed for the grouped matmul), or (experts, in, out)
_WEIGHT_DIMS = {"linear": (0, 1), "matmul": (1, 0), "grouped_linear": (1, 2), "grouped_matmul": (2, 1)}
_GATHERED = {"colwise_gather_output"}
_PACKED = {"packed_colwise", "packed_rowwise"}
PACKED_BLOCKS = 2  # transformers' split_factor: a packed weight is gate|up unless the graph says

# Hugging Face style -> fxpar style, one per line (transformers/distributed/tensor_parallel.py).
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "vocab": "vocab",
    "replicate": "replicate",
    "colwise_gather_output": "colwise_gather_output",  # the head of every causal LM in 5.x
    "colwise_rep": "colwise_gather_output",  # 4.x: ColwiseParallel(output_layouts=Replicate())
    "rowwise_split_input": "rowwise",  # the replicated input is split locally: split_to_shard
    "rowwise_rep": "rowwise",  # 4.x name of the same
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    "embedding_rowwise": "vocab",  # EmbeddingParallel(shard_dim=0): split the vocabulary
    "embedding_colwise": "colwise_gather_output",  # EmbeddingParallel(shard_dim=1), output whole
    # by whole heads (5.25, MiniCPM5's k/v): fxpar's split of a heads dim is already whole heads;
    # transformers' copies of a head when tp exceeds the heads are fxpar's "not divisible" error
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise",
    "packed_colwise": "packed_colwise",
    "packed_rowwise": "packed_rowwise",
    "gather": "colwise",
    "local": "replicate",
    "sequence_parallel": "replicate",  # fxpar's sequence parallelism is the plan's sp=true
    "replicated_with_grad_allreduce": "replicate",  # partial gradients are found in the graph
    "all_reduce": "replicate",  # partial outputs are summed where the graph needs them whole
}
# Styles fxpar cannot honour, with why; naming one is a PlanError.
UNSUPPORTED_HF_STYLES = {
    "moe_tp_experts": "mixture-of-experts weights (one 3-D tensor per module, grouped matmuls)",
    "moe_identity_expert": "mixture-of-experts routing",
    "grouped_gemm": "expert parallelism",
    "ep_dispatch_experts": "expert parallelism",
    "mla_kv_a_proj": "multi-head latent attention's half-sharded projection",
    "local_params": "bare parameters sharded by hand (attention sinks)",
}


@dataclass(frozen=True)
class Use:
    """One use of a parameter by an op: what the op is to it, and the op's weight for a bias."""

    node: fx.Node
    kind: str  # "linear" (weight (out, in)), "matmul" (weight (in, out)), "grouped_linear" (experts'
    # weights (experts, out, in)), "grouped_matmul" ((experts, in, out)), "embedding", "other"
    role: str  # "weight", "bias" or "other"
    weight: str | None = None  # for a projection's bias: its weight's parameter name


def parameter_uses(gm: fx.GraphModule) -> dict[str, tuple[Use, ...]]:
    """Every use of every parameter, in graph order."""
    uses: dict[str, list[Use]] = {name: [] for name in meta.parameter_nodes(gm.graph)}
    for name, node in meta.parameter_nodes(gm.graph).items():
        for user in node.users:
            uses[name].append(_use(node, user))
    return {name: tuple(found) for name, found in uses.items()}


def _use(parameter: fx.Node, user: fx.Node) -> Use:
    grouped = next((g for u in (user, *user.users) if (g := grouped_projection_of(u)) is not None
                    and g.parameter is parameter), None)
    if grouped is not None:  # the parameter, or its transpose, as a grouped matmul's weights
        return Use(grouped.node, "grouped_linear" if grouped.transposed else "grouped_matmul", "weight")
    projection = projection_of(user)
    if projection is not None:
        kind = "linear" if projection.out_dim == 0 else "matmul"
        if projection.weight is parameter:
            return Use(user, kind, "weight")
        if projection.bias is parameter:
            return Use(user, kind, "bias", weight=projection.weight_name)
    if packet(user) is torch.ops.aten.embedding and user.args[0] is parameter:
        return Use(user, "embedding", "weight")
    return Use(user, "other", "other")


def parameter_roles(gm: fx.GraphModule) -> dict[str, tuple[tuple[str, str], ...]]:
    """Each parameter's distinct (kind, role) pairs: (("linear", "weight"),), (("matmul",
    "bias"),), a tied embedding and head: (("embedding", "weight"), ("linear", "weight"))."""
    return {
        name: tuple(dict.fromkeys((u.kind, u.role) for u in uses)) or (("other", "other"),)
        for name, uses in parameter_uses(gm).items()
    }


def placement_for(kind: str, role: str, style: Style, *, parts: int = 1) -> Placement:
    """The placement one use of a parameter asks for under `style` (table in the module doc).

    `parts` is the number of equal blocks the graph splits the projection's output into
    (`fused_projections`); it shapes the column-parallel split only.
    """
    if style == "replicate" or kind == "other":
        return R
    if kind == "embedding":
        return Shard(0) if style in ("vocab", *_ROWWISE) else Shard(1)
    out_dim, in_dim = _WEIGHT_DIMS[kind]
    if style in _ROWWISE:
        rows = PACKED_BLOCKS if style in _PACKED else 1
        return R if role == "bias" else Shard(in_dim, rows)
    if style in _PACKED and parts == 1:
        parts = PACKED_BLOCKS
    return Shard(0, parts) if role == "bias" else Shard(out_dim, parts)


class ParameterPlacements(dict):
    """{parameter name: Placement}, and `gathered_outputs`: the module paths whose projections
    and lookups give their output whole (colwise_gather_output), for `shard_tensor_parallel`."""

    def __init__(self, placements: Mapping[str, Placement], *, gathered_outputs: frozenset[str]):
        super().__init__(placements)
        self.gathered_outputs = gathered_outputs


def parameter_placements(
    gm: fx.GraphModule, rules: Mapping[str, str] | str, *, tp: int
) -> ParameterPlacements:
    """The tensor-parallel placement of every parameter under `rules` (see module doc)."""
    uses = parameter_uses(gm)
    named = rules != "infer"
    styles = _match_rules(gm, rules) if named else infer_styles(gm)
    resolve = _StyleResolver(gm, styles)
    fused = fused_projections(gm)
    nodes = meta.parameter_nodes(gm.graph)
    placements, gathered = {}, set()
    for name, its_uses in uses.items():
        asked: dict[Placement, Use] = {}
        for use in its_uses:
            style = resolve(name, use)
            if named and use.kind == "other" and style not in (None, "replicate"):
                raise _unplaceable(name, use, style)
            if style is None or use.kind == "other":
                continue
            asked.setdefault(placement_for(use.kind, use.role, style, parts=fused.get(name, 1)), use)
            if style in _GATHERED and use.role == "weight":
                gathered.add(meta.module_path(use.node))
        if len(asked) > 1:
            raise _disagreeing_uses(name, asked)
        placement = next(iter(asked), R)
        if isinstance(placement, Shard):
            _check_divisible(name, nodes[name], placement, tp)
        placements[name] = placement
    return ParameterPlacements(placements, gathered_outputs=frozenset(gathered))


class _StyleResolver:
    """The style that applies to one use of a parameter.

    A parameter-level rule wins; then the rule of the parameter's module, where a tied
    parameter's modules are all its names' (`lm_head` and `embed_tokens`) and the one whose op
    this is counts first; a bias no rule names follows its weight (BERT's head bias lives in
    `cls.predictions`, its weight is the tied word embedding).
    """

    def __init__(self, gm: fx.GraphModule, styles: Mapping[str, Style]):
        self.styles = styles
        self.names: dict[str, list[str]] = {n: [n] for n in meta.parameter_nodes(gm.graph)}
        for alias, canonical in meta.graph_aliases(gm).items():
            self.names.setdefault(canonical, [canonical]).append(alias)

    def __call__(self, name: str, use: Use) -> Style | None:
        own = self._own(name, meta.module_path(use.node))
        if own is None and use.role == "bias" and use.weight is not None:
            return self._own(use.weight, meta.module_path(use.node))
        return own

    def _own(self, name: str, op_module: str) -> Style | None:
        names = self.names.get(name, [name])
        for candidate in names:
            if candidate in self.styles:
                return self.styles[candidate]
        modules = [_module_of(n) for n in names]
        for module in sorted(modules, key=lambda m: m != op_module):
            if module in self.styles:
                return self.styles[module]
        return None


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _check_divisible(name: str, node: fx.Node, placement: Shard, tp: int) -> None:
    size = node.meta["val"].shape[placement.dim]
    if not placement.divides(size, tp):
        blocks = f" in blocks of {placement.block_sizes(size)}" if placement.fused else ""
        raise PlanError(
            f"parameter {name!r} ({placement} under tp={tp}) has {size} rows along dim "
            f"{placement.dim}{blocks}, not divisible by tp={tp}. Fix: choose tp dividing "
            f"{' and '.join(map(str, sorted(set(placement.block_sizes(size)))))}, or replicate the module: "
            f"tp_rules={{{_module_of(name)!r}: 'replicate'}}",
            field="tp",
            value=tp,
        )


def _unplaceable(name: str, use: Use, style: Style) -> PlanError:
    module = _module_of(name)
    return PlanError(
        f"tp_rules make module {module!r} {style}, but tensor parallelism cannot split its "
        f"parameter {name!r}: it is used by {use.node.format_node()} (module "
        f"{meta.module_path(use.node) or '<root module>'!r}), which is neither a projection "
        "(linear, addmm, mm or matmul with the parameter as its weight) nor an embedding "
        f"lookup. Fix: replicate it (tp_rules={{{module!r}: 'replicate'}}) or name only the "
        "projections inside it",
        field="tp_rules",
        value=style,
    )


def _disagreeing_uses(name: str, asked: dict[Placement, Use]) -> PlanError:
    found = "; ".join(
        f"{use.kind} {use.role} in module {meta.module_path(use.node) or '<root module>'!r} "
        f"wants {placement}"
        for placement, use in asked.items()
    )
    return PlanError(
        f"parameter {name!r} is used in ways whose tensor-parallel layouts disagree: {found}. "
        "A tied weight needs one layout: split the vocabulary in both (style 'vocab' for the "
        "embedding and the head), or replicate both",
        field="tp_rules",
    )


def rules_matching_nothing(gm: fx.GraphModule, rules: Mapping[str, str]) -> list[str]:
    """The globs of `rules` that match no module path or parameter name of `gm`: for a plan a
    model declares about itself, entries its family has and this configuration lacks (a
    shared expert, a dense layer's MLP in an all-MoE config)."""
    modules, names = _rule_targets(gm)
    return [pattern for pattern in rules if not any(_matches(m, pattern) for m in modules | names)]


def _rule_targets(gm: fx.GraphModule) -> tuple[set[str], set[str]]:
    """(module paths that hold parameters, parameter names): what a rule's glob may name."""
    names = set(meta.parameter_nodes(gm.graph)) | set(meta.graph_aliases(gm))
    return {_module_of(n) for n in names}, names


def _match_rules(gm: fx.GraphModule, rules: Mapping[str, str]) -> dict[str, Style]:
    """{module path or parameter name: fxpar style} for every rule; PlanError for a rule that
    names no style fxpar honours or matches nothing."""
    modules, names = _rule_targets(gm)
    styles: dict[str, Style] = {}
    for pattern, style in rules.items():
        fxpar_style = _fxpar_style(pattern, style)
        matched = [m for m in modules | names if _matches(m, pattern)]
        if not matched:
            raise PlanError(
                f"tp_rules[{pattern!r}] matches no module of the model. Module paths with "
                f"parameters look like: {', '.join(sorted(modules)[:6])}. Fix: correct the glob",
                field="tp_rules",
                value=pattern,
            )
        for module in matched:
            styles[module] = fxpar_style
    return styles


def _matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def _fxpar_style(pattern: str, style: str) -> Style:
    if style in UNSUPPORTED_HF_STYLES:
        raise PlanError(
            f"tp_rules[{pattern!r}] = {style!r} asks for {UNSUPPORTED_HF_STYLES[style]}, which "
            f"fxpar's tensor parallelism does not do. Fix: drop the rule or replicate those "
            f"modules: tp_rules[{pattern!r}] = 'replicate'",
            field="tp_rules",
            value=style,
        )
    if style not in HF_STYLES:
        raise PlanError(
            f"tp_rules[{pattern!r}] = {style!r} is not a tensor-parallel style; use one of "
            f"{', '.join(STYLES)} (or a Hugging Face style: {', '.join(sorted(HF_STYLES))})",
            field="tp_rules",
            value=style,
        )
    return HF_STYLES[style]
