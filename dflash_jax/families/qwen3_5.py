"""The Gated-DeltaNet hybrids: Qwen3.5 / Qwen3.6 dense (``qwen3_5``) and MoE (``qwen3_5_moe``), and Qwen3-Next
(``qwen3_next``): :class:`~dflash_jax.models.hybrid.HybridTargetModel`.

What they bring beyond the shared layers: ``layer_types`` (linear-attention or gated full-attention layers,
:class:`~dflash_jax.config.HybridConfig`), a cache with per-layer conv and recurrent states
(:class:`~dflash_jax.models.hybrid.HybridCache`, which the model's forward advances by ``lengths`` or defers
until ``settle``), the text part of vision-language checkpoints (Qwen3-Next's fused projections split), and
partition rules for the DeltaNet layers and the shared expert.
"""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.config import FamilySchema, HybridConfig, ModelConfig, required
from dflash_jax.families.qwen3_moe import EXPERT_RULES, moe_fields
from dflash_jax.families.registry import Family
from dflash_jax.models import hybrid
from dflash_jax.models.moe import stack_experts

# Gated DeltaNet: channels grouped by key head, value heads next to their key head (each device holds whole key
# heads: "linear_heads" maps to tp only where it divides them); out_proj by rows. The shared expert like the MLP.
LINEAR_RULES = (
    (r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a)\.kernel$", ("embed", "linear_heads")),
    (r"linear_attn\.conv1d\.weight$", ("linear_heads", None, None)),
    (r"linear_attn\.(dt_bias|A_log)$", ("linear_heads",)),
    (r"linear_attn\.out_proj\.kernel$", ("linear_heads", "embed")),
    (r"mlp\.shared_expert\.(gate|up)_proj\.kernel$", ("embed", "mlp")),
    (r"mlp\.shared_expert\.down_proj\.kernel$", ("mlp", "embed")),
)


def hybrid_fields(cfg: Mapping[str, Any], where: str, *, fused: bool = False) -> dict[str, Any]:
    """The linear-attention settings. Absent fields take transformers' defaults (e.g. a full-attention layer
    every ``full_attention_interval`` = 4 layers, partial_rotary_factor 0.25). ``fused``: the checkpoints' DeltaNet
    projections come fused (Qwen3-Next)."""
    layers = int(required(cfg, "num_hidden_layers", where))
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)) or 0.25)
    head_dim = int(cfg.get("head_dim") or int(required(cfg, "hidden_size", where)) // int(
        required(cfg, "num_attention_heads", where)))
    return dict(hybrid=HybridConfig(
        layer_types=tuple(str(t) for t in types),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        key_heads=int(cfg.get("linear_num_key_heads", 16)),
        value_heads=int(cfg.get("linear_num_value_heads", 32)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        rotary_dim=int(head_dim * factor),
        fused_projections=fused,
    ))


def _shared_expert(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return dict(shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def qwen3_5_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    return hybrid_fields(cfg, where)


def qwen3_5_moe_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """No dense layers, and the top-k weights always renormalised."""
    return {**moe_fields(cfg, where), **hybrid_fields(cfg, where), **_shared_expert(cfg),
            **dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())}


def qwen3_5_moe_prepare(cfg: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """Every layer is sparse: the (unused) dense MLP width defaults to the experts' when absent."""
    return {**cfg, "intermediate_size": cfg.get("intermediate_size") or required(cfg, "moe_intermediate_size", where)}


def qwen3_next_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {**moe_fields(cfg, where), **hybrid_fields(cfg, where, fused=True), **_shared_expert(cfg)}


def checkpoint(cfg: ModelConfig, tensors: dict, dtype, source: str):
    """Experts stacked, then the text model's tensors in our names (:func:`dflash_jax.models.hybrid.text_tensors`)."""
    return hybrid.text_tensors(cfg, stack_experts(tensors), source)


def _family(schema: FamilySchema) -> Family:
    return Family(schema, model=hybrid.HybridTargetModel, checkpoint=checkpoint,
                  sharding_rules=LINEAR_RULES + EXPERT_RULES,
                  kernel_ops=("delta_rule",) + (("moe_experts",) if schema.moe else ()))


QWEN3_5 = _family(FamilySchema("qwen3_5", ("qwen3_5", "qwen3_5_text"), fields=qwen3_5_fields,
                               linear_attention=True))
QWEN3_5_MOE = _family(FamilySchema("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), fields=qwen3_5_moe_fields,
                                   prepare=qwen3_5_moe_prepare, moe=True, linear_attention=True))
QWEN3_NEXT = _family(FamilySchema("qwen3_next", ("qwen3_next",), fields=qwen3_next_fields, moe=True,
                                  linear_attention=True))

FAMILIES = (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT)
