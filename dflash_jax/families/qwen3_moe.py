"""Qwen3-MoE (``qwen3_moe``): Qwen3's layers with top-k routed SwiGLU experts in the layers
:meth:`~dflash_jax.config.ModelConfig.is_moe_layer` picks (:class:`~dflash_jax.models.moe.SparseMoE`).

:func:`moe_fields` and :data:`EXPERT_RULES` are shared with the hybrid MoE families (:mod:`.qwen3_5`).
"""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.config import ConfigError, FamilySchema, required
from dflash_jax.families.registry import Family

# Stacked experts [E, in, out]: every device holds a slice of every expert's hidden F (routing needs no
# communication; the router is replicated).
EXPERT_RULES = (
    (r"mlp\.experts\.(gate|up)_proj$", ("experts", "embed", "mlp")),
    (r"mlp\.experts\.down_proj$", ("experts", "mlp", "embed")),
)


def moe_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Qwen3-MoE settings (transformers 5 writes ``num_experts`` as ``num_local_experts``)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ConfigError(f"{where}: required field 'num_experts' is missing")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(required(cfg, "num_experts_per_tok", where)),
        moe_intermediate_size=int(required(cfg, "moe_intermediate_size", where)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg.get("model_type") == "qwen3_next")),  # HF defaults
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


QWEN3_MOE = Family(FamilySchema("qwen3_moe", ("qwen3_moe",), fields=moe_fields, qk_norm=True, moe=True),
                   sharding_rules=EXPERT_RULES, kernel_ops=("moe_experts",))

FAMILIES = (QWEN3_MOE,)
