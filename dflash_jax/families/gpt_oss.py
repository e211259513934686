"""gpt-oss (``gpt_oss``): :class:`~dflash_jax.models.gpt_oss.GptOssTargetModel` — attention sinks, sliding-window
layers, routed clamped-SwiGLU experts with biases in every layer, its own RMSNorm; checkpoints with fused,
interleaved or MXFP4 experts (:func:`dflash_jax.models.gpt_oss.checkpoint_tensors`)."""

from __future__ import annotations

from typing import Any, Mapping

from dflash_jax.config import ConfigError, FamilySchema, ModelConfig, required
from dflash_jax.families.qwen3_moe import EXPERT_RULES
from dflash_jax.families.registry import Family, no_tensor
from dflash_jax.models import gpt_oss

# transformers' GptOssConfig defaults, for fields a gpt_oss config.json leaves out (released configs give them all).
DEFAULTS = {"attention_bias": True, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128,
            "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def prepare(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {**DEFAULTS, **cfg}
    if not out.get("rope_parameters") and not out.get("rope_scaling"):
        out["rope_parameters"] = dict(DEFAULT_ROPE)
    return out


def fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Experts in every layer (their width is ``intermediate_size``); ``layer_types`` gives the sliding-window
    layers (transformers' default: the even-numbered ones)."""
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is None:
        raise ConfigError(f"{where}: required field 'num_local_experts' is missing")
    layers = int(required(cfg, "num_hidden_layers", where))
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ConfigError(f"{where}: layer_types has unknown kinds {bad} (gpt_oss layers are 'sliding_attention' "
                          f"or 'full_attention')")
    window = cfg.get("sliding_window")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(required(cfg, "num_experts_per_tok", where)),
        moe_intermediate_size=int(required(cfg, "intermediate_size", where)),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        sliding_window=int(window) if window is not None else None,
        swiglu_alpha=float(required(cfg, "swiglu_alpha", where)),
        swiglu_limit=float(required(cfg, "swiglu_limit", where)),
    )


def check(cfg: ModelConfig) -> None:
    cfg.check_experts()
    cfg.check_windows()
    if not cfg.swiglu_limit > 0:
        raise ConfigError(f"config field swiglu_limit must be positive, got {cfg.swiglu_limit}")


def checkpoint(cfg: ModelConfig, tensors: dict, dtype, source: str):
    """Fused, interleaved or MXFP4 experts → ``[E, …]`` per projection."""
    return gpt_oss.checkpoint_tensors(tensors, dtype), no_tensor


GPT_OSS = Family(
    FamilySchema("gpt_oss", ("gpt_oss",), fields=fields, prepare=prepare, check=check, attention_sinks=True),
    model=gpt_oss.GptOssTargetModel, checkpoint=checkpoint,
    sharding_rules=EXPERT_RULES + ((r"mlp\.experts\.(gate|up)_proj_bias$", ("experts", "mlp")),
                                   (r"self_attn\.sinks$", ("q_heads",))),
    kernel_ops=("moe_experts",))

FAMILIES = (GPT_OSS,)
